"""Scheduler half of the connector: finds prefixes (local or at a peer), plans loads and saves.

Runs in vLLM's engine-core process, on the scheduler's thread; vLLM calls it serially. It is
the only side that asks questions of the node: it pulls from peers and pins blocks
(``Acquire``) before vLLM allocates, and hands the pinned slot numbers and their lease to the
worker in the step's metadata. It never touches KV bytes.

Block identity: ``request.block_hashes`` is filled by vLLM's engine core (a block hasher is
installed whenever a KV connector is configured), one hash per full block, chained over the
prefix, with the algorithm and seed of the namespace (config.py); they are the data plane's keys.

Loads are asynchronous and the scheduler thread never waits on the network:

1. the first ``num_new_matched_tokens`` for a request starts one background task on the
   :class:`NodeLink` loop (source choice, ``Pull`` from a peer, ``Acquire`` of the local
   blocks) and answers ``None``: vLLM skips the request this step and asks again the next;
2. while the task runs every ask answers ``None`` (running requests keep decoding); a task
   older than ``pull_timeout_ms`` is abandoned (its lease is released when it ends) and the
   answer is 0: vLLM computes the prefix, within the pull deadline whatever the peer does;
3. once it ended, the ask answers the pinned tokens, and the connector tells vLLM to load
   them asynchronously: vLLM allocates blocks and parks the request in
   ``WAITING_FOR_REMOTE_KVS``; the next step's metadata carries the copies, the worker does
   them (blocks are local by then) and reports the request in ``finished_recving``.

Request states (per request, forward only until the request is preempted and asks again):
``(no task) -> pending -> answered -> loading -> loaded``.

Failure policy: any RPC failure, a dead, frozen or stale source, a grant refusal or
contradictory ``kv_transfer_params`` load nothing more (vLLM computes the rest); failed copies
come back as ``invalid_block_ids`` and vLLM recomputes from the first; nothing here raises into vLLM.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvmesh import tracing
from kvmesh.namespace import Namespace
from kvmesh.tracing import ATTR

from engine_connector.config import ConnectorConfig
from engine_connector.metadata import BlockLoad, KvmeshConnectorMetadata, SaveRun
from engine_connector.node_link import NodeLink
from engine_connector.params import NO_TRANSFER, PARAMS_KEY, InvalidTransferParams, PeerSource, TransferParams
from engine_connector.load_report import LoadReport
from engine_connector.stats import ConnectorStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
_RPC_ERRORS = (grpc.aio.AioRpcError, TimeoutError)


@dataclass(slots=True)
class _Lookup:
    """Pinned leading blocks from chain index ``first`` (the answer of one background task)."""

    first: int
    slots: list[int]
    lease: str
    peer: tuple[int, int]  # [start, end) of ``slots`` that the pull just brought from a peer


@dataclass(slots=True)
class _Task:
    """One background lookup: started at ``started`` (monotonic s) for chain index ``first``."""

    first: int
    started: float
    future: "concurrent.futures.Future[tuple[_Lookup | None, LoadReport]]"


@dataclass(slots=True)
class _Answer:
    """A finished task's answer, kept until vLLM allocates (it may ask again before)."""

    first: int
    lookup: _Lookup | None
    at: float


@dataclass(slots=True)
class _RequestState:
    request: "Request"
    params: TransferParams
    report: LoadReport = field(default_factory=LoadReport)
    stored_blocks: int = 0  # leading blocks known to be in the node's tier (saved or loaded)
    loading: dict[int, int] = field(default_factory=dict)  # block id -> chain index, latest admission
    task: _Task | None = None
    answer: _Answer | None = None
    loads_in_flight: bool = False  # copies sent to the worker, not yet reported finished
    last_split: tuple[int, int] = (0, 0)  # (local, peer) tokens of the latest accepted load


class SchedulerSide:
    def __init__(self, link: NodeLink, ns: Namespace, config: ConnectorConfig, block_size: int, *,
                 can_load: bool, can_save: bool, clock=time.monotonic) -> None:
        self._link = link
        self._ns = ns
        self._config = config
        self._block_size = block_size
        self._can_load = can_load
        self._can_save = can_save
        self._clock = clock
        self._node_id = link.describe_tier().node_id
        if link.has_control_plane:
            link.address_of(self._node_id)  # learnt in the background, for the decoders of finished requests
        self._kv_cache_manager: "KVCacheManager | None" = None
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockLoad] = []
        self._pending_leases: list[str] = []
        self._tracer = tracing.tracer("kvmesh.engine_connector")
        self.stats = ConnectorStats()

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        self._kv_cache_manager = kv_cache_manager

    # ---- admission ----

    def _state(self, request: "Request") -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            try:
                params = TransferParams.parse(request.kv_transfer_params)
                error = ""
            except InvalidTransferParams as exc:
                params, error = NO_TRANSFER, str(exc)
                logger.error("request %s: rejected kv_transfer_params: %s; running it without transfers",
                             request.request_id, exc)
            state = self._requests[request.request_id] = _RequestState(request, params)
            if error:
                state.report.outcome, state.report.error = "rejected", error
        return state

    def num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) this node holds pinned, or None: not known yet.

        Never the whole prompt: vLLM must compute at least one token to sample from. Never waits:
        the lookup and the pull run in the background (module docstring).
        """
        state = self._state(request)
        if not (self._can_load and state.params.load):
            return 0
        first = num_computed_tokens // self._block_size
        # a lookup of the leading max_lookup_blocks (a data plane refuses more: every lookup of a longer prompt
        # failed, and its prefix was always computed)
        usable = min((request.num_tokens - 1) // self._block_size, first + self._config.max_lookup_blocks)
        if usable <= first:
            return 0
        now = self._clock()
        answer = state.answer
        if answer is not None and (answer.first != first or now - answer.at > self._config.lease_ms / 2000):
            # vLLM's own cache moved the start, or the pins are about to lapse: ask the node again.
            self._drop_answer(state)
            answer = None
        if answer is None:
            if state.task is None or state.task.first != first:
                self._abandon_task(state)
                hashes = list(request.block_hashes[first:usable])
                future = self._link.submit(self._find(state.request.request_id, state.params, hashes, first))
                state.task = _Task(first, now, future)
                return None
            task = state.task
            if not task.future.done():
                if (now - task.started) * 1e3 < self._config.pull_timeout_ms:
                    return None
                state.report.outcome, state.report.error = "deadline", (
                    f"no answer within pull_timeout_ms={self._config.pull_timeout_ms}; vLLM computes the prefix")
                logger.warning("request %s: %s", request.request_id, state.report.error)
                self.stats.record_failure("deadline")
                self._abandon_task(state)
                answer = state.answer = _Answer(first, None, now)
            else:
                state.task = None
                lookup, attempt = self._result(task)
                state.report.merge(attempt)
                self.stats.record_lookup(attempt)
                answer = state.answer = _Answer(first, lookup, now)
            state.report.wait_ms += (now - task.started) * 1e3
        return len(answer.lookup.slots) * self._block_size if answer.lookup else 0

    async def _find(self, req_id: str, params: TransferParams, hashes: list[bytes],
                    first: int) -> tuple[_Lookup | None, LoadReport]:
        """The background task: choose a source, pull, pin. Never raises: failures are in the report."""
        report = LoadReport()
        with self._tracer.start_as_current_span("kvmesh.connector.load") as span:
            tracing.set_attributes(span, {ATTR.REQUEST_ID: req_id, ATTR.TENANT: self._ns.tenant,
                                          ATTR.NAMESPACE: self._ns.fingerprint, "kvmesh.blocks_wanted": len(hashes)})
            lookup = await self._find_in(req_id, params, hashes, first, report)
            hit = len(lookup.slots) if lookup else 0
            tier = "peer" if lookup and lookup.peer[1] > lookup.peer[0] else ("local" if hit else "none")
            tracing.set_attributes(span, {ATTR.BLOCKS: hit, ATTR.TIER: tier, ATTR.OUTCOME: report.outcome,
                                          ATTR.BYTES: report.bytes_pulled, ATTR.SOURCE_NODE: report.source or None})
        return lookup, report

    async def _find_in(self, req_id: str, params: TransferParams, hashes: list[bytes], first: int,
                       report: LoadReport) -> _Lookup | None:
        started = time.perf_counter()
        peer, slots, lease = (0, 0), [], ""
        try:
            source = await self._source(req_id, params, hashes, report)
        except _RPC_ERRORS as exc:
            source = None
            report.outcome, report.error = "control_plane_error", _describe(exc)
            logger.warning("request %s: no source: %s", req_id, report.error)
        if source is not None:
            try:
                peer, slots, lease = await self._pull(req_id, params, hashes, first, *source, report)
            except _RPC_ERRORS as exc:
                report.outcome, report.error = "pull_failed", _describe(exc)
                logger.warning("request %s: pull from %s failed: %s; vLLM computes what is missing", req_id,
                               source[0], report.error)
        if not lease:  # no pull, or one that pinned nothing: what is here, if anything
            try:
                slots, lease = await self._link.acquire_async(self._ns, hashes, params.local_media,
                                                              self._config.lease_ms)
            except _RPC_ERRORS as exc:
                report.outcome, report.error = "data_plane_error", _describe(exc)
                logger.warning("request %s: %s; vLLM computes the prefix", req_id, report.error)
                return None
        report.lookup_ms += (time.perf_counter() - started) * 1e3 - report.pull_ms
        if not slots:
            if report.outcome == "none":
                report.outcome = "miss"
            return None
        if report.outcome in ("none", "miss"):
            report.outcome = "hit"
        return _Lookup(first, slots, lease, peer)

    async def _source(self, req_id: str, params: TransferParams, hashes: list[bytes],
                      report: LoadReport) -> tuple[str, str] | None:
        """(node id, address) of the peer to pull from, or None."""
        if not params.peer_media:
            return None  # kv_load_tiers allows no peer tier
        if params.source is not None:
            node_id = params.source.node_id or await self._resolve(req_id, params.source, report)
            return (node_id, params.source.address) if node_id else None
        if not self._config.auto_source:
            return None
        holders = await self._link.holders_async(self._ns, hashes)
        local = next((h.leading_blocks for h in holders if h.node_id == self._node_id), 0)
        best = next((h for h in holders if h.node_id != self._node_id), None)
        if best is None or best.leading_blocks - local < self._config.min_pull_blocks:
            return None
        return best.node_id, best.address

    async def _resolve(self, req_id: str, source: PeerSource, report: LoadReport) -> str:
        node_id = await self._link.node_at_async(source.address) if self._link.has_control_plane else ""
        if not node_id:
            report.outcome = "unknown_source"
            report.error = (f"{source.kind} {source.address} names no live node (give remote_node_id, or "
                            "configure control_plane_address)")
            logger.warning("request %s: %s", req_id, report.error)
        return node_id

    async def _pull(self, req_id: str, params: TransferParams, hashes: list[bytes], first: int, node_id: str,
                    address: str, report: LoadReport) -> tuple[tuple[int, int], list[int], str]:
        """Pull from the peer, then pin the prefix in the same call: [start, end) of ``hashes`` it brought, and
        the leading blocks' slots and lease (as Acquire's; no lease when nothing was pinned)."""
        if node_id == self._node_id:
            return (0, 0), [], ""  # the source is this node: a local hit
        started = time.perf_counter()
        route_token = params.source.route_token if params.source is not None else ""
        try:
            result = await self._link.pull_async(self._ns, hashes, node_id, address,
                                                 timeout_ms=self._config.pull_timeout_ms,
                                                 source_media=params.peer_media, first_block_index=first,
                                                 route_token=route_token, lease_ms=self._config.lease_ms,
                                                 media=params.local_media)
        finally:
            report.pull_ms += (time.perf_counter() - started) * 1e3
            report.source = node_id
        if result.refused:
            report.error = result.refused
        report.bytes_pulled += result.bytes_pulled
        report.joined_blocks += result.joined
        report.peer_lookup_ms += result.lookup_ms
        report.transfer_ms += result.transfer_ms
        report.outcome = "pulled" if result.pulled else "pull_missed"
        logger.info("request %s: pulled %d block(s) from %s (%d already here) in %.1f ms", req_id,
                    result.pulled, node_id, result.already_local, (time.perf_counter() - started) * 1e3)
        return (result.already_local, result.already_local + result.pulled), result.slots, result.lease_id

    @staticmethod
    def _result(task: _Task) -> tuple[_Lookup | None, LoadReport]:
        """The ended task's answer; a task that raised (a bug, not an RPC failure) loads nothing."""
        error = task.future.exception()
        if error is None:
            return task.future.result()
        logger.error("lookup task failed: %r; vLLM computes the prefix", error)
        return None, LoadReport(outcome="error", error=repr(error))

    def _abandon_task(self, state: _RequestState) -> None:
        """Stop waiting for the request's task; whatever it pins is released when it ends."""
        task, state.task = state.task, None
        if task is not None:
            task.future.add_done_callback(self._release_result)

    def _release_result(self, future: "concurrent.futures.Future[tuple[_Lookup | None, LoadReport]]") -> None:
        if not future.cancelled() and future.exception() is None:
            lookup, _ = future.result()
            if lookup is not None:
                self._link.release(lookup.lease)

    def _drop_answer(self, state: _RequestState) -> None:
        answer, state.answer = state.answer, None
        if answer is not None and answer.lookup is not None:
            self._link.release(answer.lookup.lease)

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Queue the copies of the ``num_external_tokens`` vLLM accepted; their lease goes with them.

        vLLM calls this again, with 0, when it allocates the rest of a request after its load.
        """
        state = self._state(request)
        answer, state.answer = state.answer, None
        lookup = answer.lookup if answer is not None else None
        if num_external_tokens == 0:
            if lookup is not None:
                self._link.release(lookup.lease)
            return
        state.loading = {}
        num_blocks = num_external_tokens // self._block_size
        if lookup is None or num_external_tokens % self._block_size or num_blocks > len(lookup.slots):
            raise AssertionError(f"vLLM allocated {num_external_tokens} external tokens, "
                                 f"{len(lookup.slots) if lookup else 0} blocks were pinned")
        (block_ids,) = blocks.get_block_ids()
        for k in range(num_blocks):
            index = lookup.first + k
            self._pending_loads.append(BlockLoad(request.request_id, block_ids[index], lookup.slots[k]))
            state.loading[block_ids[index]] = index
        self._pending_leases.append(lookup.lease)
        peer = max(0, min(lookup.peer[1], num_blocks) - lookup.peer[0])
        report = state.report
        report.loaded_tokens += num_external_tokens
        report.peer_tokens += peer * self._block_size
        report.local_tokens += (num_blocks - peer) * self._block_size
        state.last_split = ((num_blocks - peer) * self._block_size, peer * self._block_size)
        self.stats.record_loaded(*state.last_split)
        # Blocks before ``first`` were in vLLM's own prefix cache: computed (and saved) here earlier.
        state.stored_blocks = max(state.stored_blocks, lookup.first + num_blocks)

    def hit_sources(self, request: "Request") -> tuple[int, int]:
        """(local, peer) tokens of the latest load vLLM accepted for ``request``."""
        state = self._requests.get(request.request_id)
        return state.last_split if state is not None else (0, 0)

    # ---- steps ----

    def build_meta(self, scheduler_output: "SchedulerOutput") -> KvmeshConnectorMetadata:
        """This step's loads (queued at allocation) and saves (full blocks this step completes)."""
        meta = KvmeshConnectorMetadata(loads=self._pending_loads, leases=self._pending_leases)
        self._pending_loads, self._pending_leases = [], []
        for req_id in {load.req_id for load in meta.loads}:
            self._requests[req_id].loads_in_flight = True
        if not self._can_save:
            return meta
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or not state.params.save:
                continue
            request = state.request
            # num_computed_tokens excludes this step; block_hashes covers only known tokens.
            full = min((request.num_computed_tokens + num_scheduled) // self._block_size, len(request.block_hashes))
            cap = 0 if state.params.decoder else (state.params.max_offload_tokens or self._config.max_offload_tokens)
            if cap:
                full = min(full, cap // self._block_size)
            if full <= state.stored_blocks:
                continue
            (block_ids,) = self._kv_cache_manager.get_block_ids(req_id)
            first = state.stored_blocks
            meta.saves.append(SaveRun(req_id, first, list(block_ids[first:full]), list(request.block_hashes[first:full]),
                                      cap, state.params.protected_blocks))
            state.stored_blocks = full
            state.report.stored_blocks = full
        return meta

    def on_connector_output(self, output: "KVConnectorOutput") -> None:
        """Loads the worker finished; failed ones are accounted (vLLM recomputes them, they are saved again)."""
        for req_id in output.finished_recving or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.loads_in_flight = False
        if not output.invalid_block_ids:
            return
        for state in self._requests.values():
            failed = [index for block_id, index in state.loading.items() if block_id in output.invalid_block_ids]
            if failed:
                state.report.failed_blocks += len(failed)
                state.stored_blocks = min(state.stored_blocks, min(failed))
                self.stats.record_failure("copy", blocks=len(failed))
                logger.warning("request %s: %d block(s) failed to load; vLLM recomputes from block %d",
                               state.request.request_id, len(failed), min(failed))

    def finished(self, request: "Request") -> tuple[bool, dict[str, Any]]:
        """Forget the request: (whether vLLM must keep its blocks until the worker's copies end, its report
        and, for a decoder, where to pull its blocks)."""
        req_id = request.request_id
        state = self._requests.pop(req_id, None)
        if state is None:
            return False, {PARAMS_KEY: LoadReport().as_dict()}
        self._abandon_task(state)
        self._drop_answer(state)
        unsent = [load for load in self._pending_loads if load.req_id == req_id]
        if unsent:  # allocated, never sent to the worker: nothing will write its blocks
            self._pending_loads = [load for load in self._pending_loads if load.req_id != req_id]
        delay = state.loads_in_flight
        state.report.stored_blocks = state.stored_blocks
        out: dict[str, Any] = {PARAMS_KEY: state.report.as_dict()}
        if state.params.decoder is not None:
            out["remote_kv_source"] = self._for_decoder(state)
        return delay, out

    def _for_decoder(self, state: _RequestState) -> dict[str, Any]:
        """``remote_kv_source`` naming this node, for the decoder the producer keeps the blocks for."""
        address = ""
        if self._link.has_control_plane:
            try:
                address = self._link.address_of(self._node_id)
            except _RPC_ERRORS:
                address = ""
        host, _, port = (address or self._config.data_plane_address).rpartition(":")
        return {"kv_request_id": str(state.params.decoder.get("kv_request_id", state.request.request_id)),
                "remote_host": host.strip("[]"), "remote_port": int(port), "remote_node_id": self._node_id,
                "cached_tokens": state.stored_blocks * self._block_size}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"data plane RPC failed: {exc.code().name} {exc.details()}"
    return f"data plane RPC timed out ({type(exc).__name__})"
