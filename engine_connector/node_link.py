"""The engine's line to its node: the local data plane and, optionally, the control plane.

vLLM calls the connector synchronously; kvmesh's clients are ``grpc.aio``. A
:class:`NodeLink` owns one event loop on a daemon thread and runs every RPC there, waiting
for the answer (``call``) or not (``post``: releases, which nothing waits for). The caller's
OpenTelemetry context is carried onto the loop, so RPC spans are children of the connector's.

The scheduler side's lookups and pulls run in the background: the ``*_async`` coroutines are
composed into one task per request and started with ``submit``, which returns a
``concurrent.futures.Future`` the scheduler polls between steps (it never waits on a peer).

Threading model: any thread may call; coroutines run on the loop thread, interleaved at their
awaits. Errors stay ``grpc.aio.AioRpcError`` (or ``TimeoutError``); the sides decide what a
failure means (always: recompute, never fail the request).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvmesh import tracing
from kvmesh.channels import ClientTLS, channel
from kvmesh.namespace import Namespace
from kvmesh.v1 import common_pb2, control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc

from data_plane.client import DataPlaneClient, TierDescription
from data_plane.types import Medium, PullResult

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Holder:
    """A node holding a prefix, from ``LookupPrefix`` (CPU-tier blocks only: peers serve pulls from CPU)."""

    node_id: str
    address: str
    leading_blocks: int


class NodeLink:
    def __init__(self, data_plane_address: str, key: str, control_plane_address: str = "",
                 rpc_timeout_s: float = 5.0, tls: ClientTLS | None = None,
                 control_plane_tls: ClientTLS | None = None) -> None:
        """``tls``: how to reach the data plane, and the control plane unless ``control_plane_tls`` says (None:
        plaintext)."""
        self.data_plane_address = data_plane_address
        self._timeout = rpc_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvmesh-connector-rpc", daemon=True)
        self._thread.start()
        self._key = key
        # grpc.aio channels belong to the loop they are created on.
        self._dp: DataPlaneClient = self.call(self._make(lambda: DataPlaneClient(data_plane_address, key=key,
                                                                                 tls=tls)))
        self._cp = None
        if control_plane_address:
            self._cp_channel = self.call(self._make(lambda: channel(control_plane_address, key,
                                                                           control_plane_tls or tls)))
            self._cp = cp_grpc.ControlPlaneStub(self._cp_channel)
        self._node_ids: dict[str, str] = {}  # data-plane address -> node id (from ListNodes; written on the loop)
        self._listing = threading.Event()  # a background ListNodes of address_of's is running

    @staticmethod
    async def _make(factory):
        return factory()

    # ---- running coroutines on the loop ----

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop under the caller's trace context; wait at most ``timeout`` (+1 s slack)."""
        future = asyncio.run_coroutine_threadsafe(tracing.run_in_context(tracing.current_context(), coro), self._loop)
        try:
            return future.result((timeout or self._timeout) + 1.0)
        except TimeoutError:
            future.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> "concurrent.futures.Future[T]":
        """Start ``coro`` on the loop under the caller's trace context; its future (never waited on here)."""
        return asyncio.run_coroutine_threadsafe(tracing.run_in_context(tracing.current_context(), coro), self._loop)

    def post(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        """Run ``coro`` without waiting; a failure is logged."""
        future = asyncio.run_coroutine_threadsafe(tracing.run_in_context(tracing.current_context(), coro), self._loop)
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                                 or log.warning("%s failed: %s", what, f.exception()))

    def close(self) -> None:
        async def shutdown() -> None:
            await self._dp.close()
            if self._cp is not None:
                await self._cp_channel.close()

        try:
            self.call(shutdown(), timeout=2.0)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)

    # ---- the local data plane ----

    def describe_tier(self) -> TierDescription:
        return self.call(self._dp.describe_tier(timeout=self._timeout))

    def acquire(self, ns: Namespace, hashes: list[bytes], media: Iterable[Medium], lease_ms: int) -> tuple[list[int], str]:
        return self.call(self.acquire_async(ns, hashes, media, lease_ms))

    async def acquire_async(self, ns: Namespace, hashes: list[bytes], media: Iterable[Medium],
                            lease_ms: int) -> tuple[list[int], str]:
        return await self._dp.acquire(ns, hashes, media=media, lease_ms=lease_ms, timeout=self._timeout)

    def release(self, lease_id: str) -> None:
        if lease_id:
            self.post(self._dp.release(lease_id, timeout=self._timeout), f"releasing lease {lease_id}")

    async def pull_async(self, ns: Namespace, hashes: list[bytes], source_node_id: str, source_address: str, *,
                         timeout_ms: int, source_media: Iterable[Medium], first_block_index: int,
                         route_token: str = "", lease_ms: int = 0, media: Iterable[Medium] = ()) -> PullResult:
        """Pull from a peer through the local data plane: the data plane bounds it by ``timeout_ms``,
        the RPC's own deadline adds 2 s for the answer to come back. ``route_token``: Route's signature on
        the source, as the request carried it (nodes with require_route_token need it). ``lease_ms`` > 0: the
        pull ends with the Acquire of ``hashes`` in ``media`` (the result's ``slots`` and ``lease_id``)."""
        return await self._dp.pull(ns, hashes, source_node_id, source_address, timeout_ms=timeout_ms,
                                   source_media=source_media, first_block_index=first_block_index,
                                   route_token=route_token, lease_ms=lease_ms, media=media,
                                   timeout=timeout_ms / 1000 + 2.0)

    def reserve(self, ns: Namespace, hashes: list[bytes], *, max_offload_tokens: int, first_block_index: int,
                protected_blocks: int) -> list[int]:
        return self.call(self._dp.reserve(ns, hashes, max_offload_tokens=max_offload_tokens,
                                          first_block_index=first_block_index, protected_blocks=protected_blocks,
                                          timeout=self._timeout))

    def commit(self, ns: Namespace, hashes: list[bytes]) -> int:
        return self.call(self._dp.commit(ns, hashes, timeout=self._timeout))

    def abort(self, ns: Namespace, hashes: list[bytes]) -> None:
        self.post(self._dp.abort(ns, hashes, timeout=self._timeout), "aborting reservations")

    # ---- the control plane ----

    @property
    def has_control_plane(self) -> bool:
        return self._cp is not None

    async def holders_async(self, ns: Namespace, hashes: list[bytes]) -> list[Holder]:
        """Nodes holding leading ``hashes`` in their CPU tier, longest first."""
        assert self._cp is not None, "no control plane configured"
        reply = await self._cp.LookupPrefix(cp_pb.LookupPrefixRequest(
            namespace=ns.to_proto(), packed_block_hashes=b"".join(hashes), media=[common_pb2.MEDIUM_CPU]), timeout=self._timeout)
        return [Holder(h.node_id, h.data_plane_address, h.leading_blocks) for h in reply.holders]

    async def node_at_async(self, address: str) -> str:
        """The id of the node whose data plane is at ``address`` ("" when the control plane knows none)."""
        if address not in self._node_ids and self._cp is not None:
            reply = await self._cp.ListNodes(cp_pb.ListNodesRequest(), timeout=self._timeout)
            for status in reply.nodes:
                if status.live:
                    self._node_ids[status.node.data_plane_address] = status.node.node_id
        return self._node_ids.get(address, "")

    def address_of(self, node_id: str) -> str:
        """The advertised data-plane address of ``node_id`` as last listed ("" when not known yet). It never waits
        on the network (the engine's scheduler thread calls it, for each finished request a decoder pulls): an
        unknown node starts one ListNodes in the background, for the calls after it. Found in review: a blocking
        ListNodes stalled the engine's step up to rpc_timeout_s per finished request while the control plane
        was frozen."""
        found = next((a for a, n in list(self._node_ids.items()) if n == node_id), "")
        if not found and self._cp is not None and not self._listing.is_set():
            self._listing.set()
            self.submit(self.node_at_async("")).add_done_callback(lambda _: self._listing.clear())
        return found
