"""Scheduler half of the connector: decides which blocks to load and save each step.

Runs in vLLM's engine-core process, on the scheduler's thread; vLLM calls it serially, so
it holds no locks. It sees requests, their block hashes and their block ids, never KV
bytes: it only asks the store which prefixes exist (:meth:`BlockStore.lookup`).

Block identity: ``request.block_hashes`` is filled by vLLM's engine core (a block hasher is
installed whenever a KV connector is configured, even with prefix caching off), one hash
per full block of ``block_size`` tokens, chained over the prefix. They are the store keys.

Loads are synchronous: a hit is loaded by the worker in the same step that computes the
rest of the prompt, before the forward (``get_num_new_matched_tokens`` returns
``(tokens, False)``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_connector.block_store import BlockStore
from engine_connector.metadata import PARAMS_KEY, BlockTransfer, KvmeshConnectorMetadata, TransferParams

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RequestState:
    request: "Request"
    params: TransferParams
    # Leading blocks of the request known to be in the store (saved or found there).
    stored_blocks: int = 0
    # Block id -> block index, for blocks loaded at the latest admission.
    loading: dict[int, int] = field(default_factory=dict)
    loaded_tokens: int = 0
    failed_blocks: int = 0


class SchedulerSide:
    """Plans loads and saves; see the module docstring for threading and identity."""

    def __init__(self, store: BlockStore, block_size: int, *, can_load: bool, can_save: bool) -> None:
        self._store = store
        self._block_size = block_size
        self._can_load = can_load
        self._can_save = can_save
        self._kv_cache_manager: "KVCacheManager | None" = None
        # req_id -> (first block, hit blocks) of the latest lookup, consumed at allocation.
        self._lookups: dict[str, tuple[int, int]] = {}
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockTransfer] = []

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        self._kv_cache_manager = kv_cache_manager

    def num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (block-aligned) that the store can supply.

        Never the whole prompt: vLLM must compute at least one token to sample from.
        """
        if not (self._can_load and TransferParams.from_request_params(request.kv_transfer_params).load):
            return 0
        first = num_computed_tokens // self._block_size
        usable = (request.num_tokens - 1) // self._block_size
        hits = self._store.lookup(request.block_hashes[first:usable]) if usable > first else 0
        self._lookups[request.request_id] = (first, hits)
        return hits * self._block_size

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Record the request and queue loads for its ``num_external_tokens`` external tokens."""
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            params = TransferParams.from_request_params(request.kv_transfer_params)
            state = self._requests[req_id] = _RequestState(request=request, params=params)
            if self._can_save and params.save:
                state.stored_blocks = self._store.lookup(request.block_hashes)
        first, hits = self._lookups.pop(req_id, (0, 0))
        state.loading = {}
        if num_external_tokens == 0:
            return
        num_blocks = num_external_tokens // self._block_size
        if num_external_tokens % self._block_size or num_blocks > hits:
            raise AssertionError(f"vLLM allocated {num_external_tokens} external tokens, lookup found {hits} blocks")
        (block_ids,) = blocks.get_block_ids()
        for index in range(first, first + num_blocks):
            self._pending_loads.append(BlockTransfer(req_id, block_ids[index], request.block_hashes[index]))
            state.loading[block_ids[index]] = index
        state.loaded_tokens += num_external_tokens

    def build_meta(self, scheduler_output: "SchedulerOutput") -> KvmeshConnectorMetadata:
        """This step's loads (queued at allocation) and saves (blocks this step completes)."""
        meta = KvmeshConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
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
            if full <= state.stored_blocks:
                continue
            (block_ids,) = self._kv_cache_manager.get_block_ids(req_id)
            meta.saves.extend(
                BlockTransfer(req_id, block_ids[i], request.block_hashes[i]) for i in range(state.stored_blocks, full)
            )
            state.stored_blocks = full
        return meta

    def on_connector_output(self, output: "KVConnectorOutput") -> None:
        """Account failed loads; their blocks are recomputed by vLLM and saved again."""
        if not output.invalid_block_ids:
            return
        for state in self._requests.values():
            failed = [index for block_id, index in state.loading.items() if block_id in output.invalid_block_ids]
            if failed:
                state.failed_blocks += len(failed)
                state.stored_blocks = min(state.stored_blocks, min(failed))
                logger.warning(
                    "request %s: %d block(s) failed to load; vLLM recomputes from block %d",
                    state.request.request_id,
                    len(failed),
                    min(failed),
                )

    def finished(self, request: "Request") -> dict[str, Any]:
        """Forget the request; return its ``kv_transfer_params`` report for the output."""
        self._lookups.pop(request.request_id, None)
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return {PARAMS_KEY: {"loaded_tokens": 0, "failed_blocks": 0, "stored_blocks": 0}}
        return {
            PARAMS_KEY: {
                "loaded_tokens": state.loaded_tokens,
                "failed_blocks": state.failed_blocks,
                "stored_blocks": state.stored_blocks,
            }
        }
