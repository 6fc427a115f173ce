"""A small client for custom schedulers: ask the control plane where a request should run.

Example (docs/scheduling.md's quick start runs it end to end)::

    from control_plane.scheduler_client import Candidate, SchedulerClient

    namespace = SchedulerClient.namespace_for("/models/m", tenant="acme", block_size=32, kv_dtype="bfloat16")
    async with SchedulerClient("cp:50051", namespace, api_key=key) as client:
        decision = await client.route(
            [Candidate("engine-a", "node-a", waiting_requests=2, running_tokens=9000),
             Candidate("engine-b", "node-b")],
            token_ids=prompt_ids)
        send_to(decision.engine_id, kv_transfer_params=decision.kv_transfer_params())

The namespace must be exactly the engines' (any field off and every lookup finds nothing):
``namespace_for`` applies the rule the engine connector and ``kvmesh vllm-events`` apply
(``kvmesh.namespace.engine_namespace``) to the settings the engines were started with.

``decision.kv_transfer_params()`` is ``{"remote_kv_source": {...}}`` when the
control plane named a peer to pull the prefix from, else ``{}``. Errors are
``grpc.aio.AioRpcError`` with the status codes of docs/api.md.

With such a source, ``route`` also hands Route's prefetch order to the chosen
engine's data plane (``DataPlane.Prefetch``), which starts the pull at once:
the engine's own ask joins it later (docs/scheduling.md#prefetch-at-route-time).
``route(..., prefetch=False)`` opts a request out; the order's outcome is in
``decision.prefetch_status`` (a failed hand-over only costs the head start).

A scheduler that only needs prefix lookups, at a high rate, calls
``await client.lookup_prefix(token_ids=...)`` from as many tasks as it likes:
the lookups share one ``LookupPrefixBatches`` stream the client keeps open, those
that queue meanwhile going several to a message (answers in request order), which
costs the control plane a fraction of a unary call each (docs/scheduling.md).

A scheduler that looks up more often still keeps the namespace's block map in memory:
``await client.start_replica()`` opens ``WatchBlockMap`` (the server sends this tenant's namespace only: a
snapshot, then its changes) and from then on ``lookup_prefix`` answers in-process, without a round trip,
while the replica is in sync (it falls back to the stream while it reconnects). A replica's answer may be
behind the control plane's by its lag: a stale holder costs at most a MISS at that source.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import Literal, Sequence

import grpc

from kvmesh.channels import ClientTLS, channel
from kvmesh.hashing import Extras, HashAlgo
from kvmesh.namespace import VLLM_DEFAULT_HASH_ALGO, Namespace, engine_namespace
from kvmesh import tracing
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc
from kvmesh.v1 import data_plane_pb2 as dp_pb, data_plane_pb2_grpc as dp_grpc

from control_plane import wire as cp_wire
from control_plane.watch import ReplicaView, block_map_update
from control_plane.model import Medium, PrefixMatch, tier_mask
from control_plane.routing import wire
from control_plane.routing.types import (
    Candidate, EngineSample, LinkSample, Policy, PullOutcome, RouteDecision, RouteRequest, StatsReport,
)

__all__ = ["Candidate", "EngineSample", "LinkSample", "Medium", "Policy", "PrefixMatch", "PullOutcome",
           "RouteDecision", "SchedulerClient"]

log = logging.getLogger(__name__)

PREFETCH_CALL_TIMEOUT_S = 1.0  # the hand-over answers at once (the pull runs in the background)


class SchedulerClient:
    def __init__(self, address: str, namespace: Namespace | common_pb2.Namespace, *, api_key: str | None = None,
                 timeout_s: float = 5.0, tls: ClientTLS | None = None,
                 peer_tls_name: Literal["node-id", "address"] = "node-id") -> None:
        """``namespace``: the engines' (:meth:`namespace_for`), or the same as a ``kvmesh.v1.Namespace`` message.
        ``api_key``: a scheduler key of the namespace's tenant (or an admin key). ``tls``: the control plane's CA
        (and this client's certificate when it requires mutual TLS; its ``server_name``, the name checked in the
        control plane's certificate); None: plaintext. ``peer_tls_name``: what the certificate of a data plane
        that a prefetch order goes to must name, as the data planes' own setting: its node id, or the host of its
        address."""
        if isinstance(namespace, common_pb2.Namespace):
            namespace = Namespace.from_proto(namespace)
        elif not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a kvmesh.namespace.Namespace (SchedulerClient.namespace_for) or a "
                            f"kvmesh.v1.Namespace message, not {type(namespace).__name__}")
        self.namespace = namespace.validate()
        self._channel = channel(address, None, tls)
        self._stub = pb_grpc.ControlPlaneStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout = timeout_s
        self._lookups: _LookupStream | None = None
        self._replica: ReplicaView | None = None
        self._watching: asyncio.Task | None = None
        self._tls = tls
        self._peer_tls_name = peer_tls_name
        # (address, node id) -> channel, for prefetch orders
        self._data_planes: dict[tuple[str, str], grpc.aio.Channel] = {}

    @staticmethod
    def namespace_for(model: str, *, block_size: int, kv_dtype: str, tenant: str = "default",
                      weight_version: str = "", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                      hash_algo: str | HashAlgo = VLLM_DEFAULT_HASH_ALGO, hash_seed: str = "") -> Namespace:
        """The namespace the kvmesh-connected engines (and ``kvmesh vllm-events``) publish their blocks under,
        from the settings they were started with: ``model`` the served model name (``--served-model-name``, else
        the model exactly as given to ``vllm serve``; the connector's ``model`` key when set), ``block_size``
        ``--block-size``, ``kv_dtype`` ``--kv-cache-dtype`` unless ``auto``, else the dtype served in (``--dtype``,
        resolved: ``bfloat16`` for ``auto`` on CPU with a float32 or bfloat16 checkpoint), ``tenant`` and
        ``weight_version`` the connector's keys, ``hash_algo`` ``--prefix-caching-hash-algo``, ``hash_seed`` the
        engines' ``PYTHONHASHSEED``. An engine logs the namespace it publishes under when it starts
        (``KvmeshConnector: blocks of namespace ...``): compare the fingerprint. ``InvalidArgument`` when a field
        is not valid."""
        return engine_namespace(model, block_size=block_size, kv_dtype=kv_dtype, tenant=tenant,
                                weight_version=weight_version, tensor_parallel_size=tensor_parallel_size,
                                pipeline_parallel_size=pipeline_parallel_size, hash_algo=hash_algo,
                                hash_seed=hash_seed)

    async def route(self, candidates: Sequence[Candidate], *, token_ids: Sequence[int] = (),
                    block_hashes: Sequence[bytes] = (), prompt_tokens: int = 0, extras: Extras = Extras(),
                    policy: Policy | None = None, p2p: bool = True, min_cached_token_delta: int = 0,
                    kv_bytes_per_token: int = 0, kv_request_id: str = "", prefetch: bool = True) -> RouteDecision:
        """The engine to run on, the KV source to pull from (if any) and why. ``policy`` None: the server's.
        ``prefetch``: hand Route's prefetch order (if any) to the chosen engine's data plane, which starts the
        pull now; False: no order is asked for (the engine pulls when it first sees the request)."""
        request = RouteRequest(self.namespace, tuple(candidates), tuple(block_hashes), tuple(token_ids), extras,
                               prompt_tokens, policy, p2p, min_cached_token_delta, kv_bytes_per_token,
                               kv_request_id, prefetch)
        with tracing.tracer("kvmesh.scheduler").start_as_current_span("kvmesh.scheduler.route"):
            reply = await self._stub.Route(wire.route_request_to_pb(request), metadata=self._metadata,
                                           timeout=self._timeout)
            decision = wire.route_decision(reply)
            if decision.prefetch is not None:
                decision = dataclasses.replace(decision, prefetch_status=await self._hand_over(decision))
        return decision

    async def _hand_over(self, decision: RouteDecision) -> str:
        """Gives the prefetch order to its data plane; its answer (``STARTED``, ``IN_FLIGHT``, ``DISABLED``,
        ``OVER_CAP``), or the status code of a failed call (logged: the engine then pulls on its own)."""
        order = decision.prefetch
        where = (order.data_plane_address, order.node_id)
        ch = self._data_planes.get(where)
        if ch is None:
            tls = self._tls
            if tls is not None:
                tls = dataclasses.replace(tls, server_name=order.node_id if self._peer_tls_name == "node-id" else None)
            ch = self._data_planes[where] = channel(order.data_plane_address, None, tls)
        request = dp_pb.PrefetchRequest(namespace=self.namespace.to_proto(), block_hashes=order.block_hashes,
                                        ticket=order.ticket)
        try:
            # no API key: the ticket is the authority, and the node (whoever holds its key) must not get ours
            reply = await dp_grpc.DataPlaneStub(ch).Prefetch(request,
                                                             timeout=min(self._timeout, PREFETCH_CALL_TIMEOUT_S))
        except grpc.aio.AioRpcError as exc:
            log.warning("prefetch order to %s (%s) failed: %s %s", order.node_id, order.data_plane_address,
                        exc.code().name, exc.details())
            return exc.code().name
        return dp_pb.PrefetchStatus.Name(reply.status).removeprefix("PREFETCH_STATUS_")

    async def report_stats(self, *, links: Sequence[LinkSample] = (), engines: Sequence[EngineSample] = (),
                           pulls: Sequence[PullOutcome] = ()) -> None:
        """Measured figures for the cost model, and outcomes of routed pulls."""
        report = StatsReport(tuple(links), tuple(engines), tuple(pulls))
        await self._stub.ReportStats(wire.stats_report_to_pb(report), metadata=self._metadata,
                                     timeout=self._timeout)

    async def lookup_prefix(self, *, token_ids: Sequence[int] = (), block_hashes: Sequence[bytes] = (),
                            extras: Extras = Extras(), media: Sequence[Medium] = ()) -> PrefixMatch:
        """Which live nodes hold the longest prefix of the prompt, per tier (``media`` empty: every tier).

        Sent on the one ``LookupPrefixBatches`` stream this client keeps open (opened on first use, and again
        after it ends); concurrent callers pipeline on it, the lookups that queue while one message is written
        going together in the next (up to LOOKUP_BATCH a message). A lookup the server refuses in a batch of
        its own raises the stream's status; when a batch of several fails (the server names none of them), or
        the stream broke, the lookups it left unanswered are sent once more as unary ``LookupPrefix`` calls, each
        within what is left of its ``timeout_s``: each gets its answer, the refused one its own status."""
        if self._replica is not None and self._replica.synced:
            return self._local_lookup(token_ids, block_hashes, extras, media)
        request = cp_wire.lookup_request_to_pb(self.namespace, block_hashes, token_ids, extras, media)
        if self._lookups is None or self._lookups.ended:
            self._lookups = _LookupStream(self._stub, self._metadata)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        try:
            reply = await asyncio.wait_for(self._lookups.lookup(request), self._timeout)
        except _Unanswered:  # lookups are read-only: the unary call gives the answer, or the exact status
            reply = await self._stub.LookupPrefix(request, metadata=self._metadata,
                                                  timeout=max(deadline - loop.time(), MIN_RETRY_TIMEOUT_S))
        return cp_wire.prefix_match(reply)

    async def start_replica(self, timeout_s: float = 10.0) -> None:
        """Keeps the namespace's block map in memory (``WatchBlockMap``); returns once the snapshot is in. The
        server's refusal (PERMISSION_DENIED: this key may not read the namespace's tenant) is raised here; a
        stream that ends later is opened again (a new snapshot)."""
        if self._watching is not None:
            return
        self._replica = view = ReplicaView()
        first: asyncio.Future = asyncio.get_running_loop().create_future()
        self._watching = asyncio.ensure_future(self._watch(view, first))
        try:
            await asyncio.wait_for(asyncio.shield(first), timeout_s)
        except BaseException:
            await self._stop_replica()
            raise

    @property
    def replica(self) -> ReplicaView | None:
        """The in-memory replica (:meth:`start_replica`), or None."""
        return self._replica

    def _local_lookup(self, token_ids, block_hashes, extras, media) -> PrefixMatch:
        hashed = list(block_hashes)
        if token_ids:
            cfg = self.namespace.cache_config
            hashed = cfg.hasher().block_hashes(list(token_ids), cfg.block_size, extras)
        match = self._replica.lookup(hashed, tier_mask(list(media)))
        return PrefixMatch(match.blocks_queried, match.holders, hashed if token_ids else [])

    async def _watch(self, view: ReplicaView, first: asyncio.Future) -> None:
        request = pb.WatchBlockMapRequest(namespace=self.namespace.to_proto())
        delay = 0.1
        while True:
            try:
                async for msg in self._stub.WatchBlockMap(request, metadata=self._metadata):
                    view.apply(block_map_update(msg))
                    delay = 0.1
                    if view.synced and not first.done():
                        first.set_result(None)
            except grpc.aio.AioRpcError as exc:
                if not first.done():
                    first.set_exception(exc)
                    return
            view.synced = False  # lookups go to the server until the next snapshot is in
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _stop_replica(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
        self._watching = self._replica = None

    async def close(self) -> None:
        await self._stop_replica()
        if self._lookups is not None:
            await self._lookups.close()
        for ch in self._data_planes.values():
            await ch.close()
        await self._channel.close()

    async def __aenter__(self) -> "SchedulerClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class _Unanswered(Exception):
    """The stream ended before this lookup's answer (a lookup failed, or the stream broke): ask again."""


LOOKUP_BATCH = 64  # most lookups the client sends in one LookupPrefixBatches message (the server takes 256)
MIN_RETRY_TIMEOUT_S = 0.05  # an unanswered lookup's unary retry gets what is left of its timeout, at least this


class _LookupStream:
    """One open ``LookupPrefixBatches`` stream: lookups queue, and whatever queued while the previous message was
    being written goes as the next batch (a lone lookup goes at once, alone); answers matched in order."""

    def __init__(self, stub: pb_grpc.ControlPlaneStub, metadata) -> None:
        self._call = stub.LookupPrefixBatches(metadata=metadata)
        self._queued: list[tuple[pb.LookupPrefixRequest, asyncio.Future]] = []
        self._waiting: collections.deque[list[asyncio.Future]] = collections.deque()  # one entry per batch sent
        self._wake = asyncio.Event()
        self.ended = False
        self._writer = asyncio.ensure_future(self._write())
        self._reader = asyncio.ensure_future(self._read())

    async def lookup(self, request: pb.LookupPrefixRequest) -> pb.LookupPrefixResponse:
        if self.ended:
            raise _Unanswered
        answer = asyncio.get_running_loop().create_future()
        self._queued.append((request, answer))
        self._wake.set()
        return await answer

    async def _write(self) -> None:
        try:
            while not self.ended:
                await self._wake.wait()
                self._wake.clear()
                while self._queued and not self.ended:
                    batch, self._queued = self._queued[:LOOKUP_BATCH], self._queued[LOOKUP_BATCH:]
                    self._waiting.append([answer for _, answer in batch])
                    await self._call.write(pb.LookupPrefixBatch(lookups=[request for request, _ in batch]))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the stream is ending: the reader settles every waiting answer

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            while (reply := await self._call.read()) is not grpc.aio.EOF:
                for answer, result in zip(self._waiting.popleft(), reply.answers):
                    if not answer.done():
                        answer.set_result(result)
        except grpc.aio.AioRpcError as exc:
            # grpc.aio marks a call INTERNAL ("Internal error from Core") when a write loses the race with the
            # server's end of the stream, hiding the server's status: then every unanswered lookup is asked again.
            error = None if exc.code() == grpc.StatusCode.INTERNAL else exc
        finally:
            self.ended = True
            self._wake.set()
            if error is not None and self._waiting and len(self._waiting[0]) == 1:
                answer = self._waiting.popleft()[0]  # the first unanswered batch, of one lookup: the refused one
                if not answer.done():
                    answer.set_exception(error)
            # The server names no lookup of a failed batch of several: each is asked again (as a unary call,
            # which answers it or gives its own status).
            unanswered = [answer for batch in self._waiting for answer in batch]
            unanswered += [answer for _, answer in self._queued]
            self._waiting.clear()
            self._queued = []
            for answer in unanswered:
                if not answer.done():
                    answer.set_exception(_Unanswered())

    async def close(self) -> None:
        self.ended = True
        self._wake.set()
        self._call.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)
