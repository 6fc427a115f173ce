"""Worker half of the connector: copies blocks between the node's shared-memory tier and vLLM's KV cache.

Runs in the process that owns the KV cache, on the model runner's thread. The node's CPU tier
is mapped into this process (``SharedTier``), so loads and saves are memory copies:

* loads (``start_load_kv``, before the forward): the scheduler side already pinned the slots
  (``Acquire``); copy each slot into its engine block, then release the step's leases;
* saves (``wait_for_save``, after the forward; on CPU every layer's KV of the step is then in
  the cache): ``Reserve`` slots for the step's newly full blocks, copy, ``Commit`` (the data
  plane checksums and publishes them). ``-1`` slots (already stored, beyond the request's
  offload cap, or no evictable slot) are skipped.

A failed copy is reported through ``take_failed_block_ids`` and vLLM recomputes from the first
failed block. The saves of a step with failed loads are dropped: tokens computed in that step
attended to the unloaded blocks, so their KV must not be published. A failed save RPC loses
only future hits.
"""

from __future__ import annotations

import logging
import time

import grpc
import torch

from kvmesh.namespace import Namespace

from data_plane.client import SharedTier
from engine_connector.kv_layout import PagedKVLayout
from engine_connector.metadata import KvmeshConnectorMetadata, SaveRun
from engine_connector.node_link import NodeLink

logger = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, link: NodeLink, ns: Namespace) -> None:
        self._link = link
        self._ns = ns
        self._tier: SharedTier | None = None
        self._layout: PagedKVLayout | None = None
        self._failed_block_ids: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's per-layer caches and map the node's tier; their block sizes must agree."""
        layout = PagedKVLayout(kv_caches)
        tier = SharedTier.open(self._link.describe_tier())
        if layout.block_nbytes != tier.block_bytes:
            tier.close()
            raise ValueError(f"engine KV blocks are {layout.block_nbytes} bytes, the data plane's slots "
                             f"{tier.block_bytes}: start the data plane with --block-bytes {layout.block_nbytes}")
        self._layout, self._tier = layout, tier

    def load(self, meta: KvmeshConnectorMetadata) -> None:
        """Copy ``meta.loads`` into the cache; remember blocks that could not be copied; release leases."""
        if not meta.loads:
            for lease in meta.leases:
                self._link.release(lease)
            return
        layout, tier = self._require()
        started = time.perf_counter()
        failed = 0
        for load in meta.loads:
            try:
                layout.write_block(load.block_id, tier.slot(load.slot))
            except (IndexError, ValueError) as exc:
                failed += 1
                self._failed_block_ids.add(load.block_id)
                logger.warning("request %s: loading slot %d failed: %s", load.req_id, load.slot, exc)
        for lease in meta.leases:
            self._link.release(lease)
        logger.info("loaded %d of %d block(s) in %.1f ms", len(meta.loads) - failed, len(meta.loads),
                    (time.perf_counter() - started) * 1e3)

    def save(self, meta: KvmeshConnectorMetadata) -> None:
        """Reserve, copy and commit ``meta.saves``, unless this step's loads failed."""
        if not meta.saves:
            return
        if self._failed_block_ids:
            logger.warning("dropping the saves of %d request(s): this step had failed loads", len(meta.saves))
            return
        started = time.perf_counter()
        written: list[bytes] = []
        for run in meta.saves:
            written += self._save_run(run)
        if not written:
            return
        try:
            self._link.commit(self._ns, list(dict.fromkeys(written)))
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            logger.warning("committing %d block(s) failed (%s); they stay unpublished", len(written), exc)
            self._link.abort(self._ns, list(dict.fromkeys(written)))
            return
        logger.info("saved %d block(s) in %.1f ms", len(written), (time.perf_counter() - started) * 1e3)

    def _save_run(self, run: SaveRun) -> list[bytes]:
        layout, tier = self._require()
        try:
            slots = self._link.reserve(self._ns, run.block_hashes, max_offload_tokens=run.max_offload_tokens,
                                       first_block_index=run.first_index, protected_blocks=run.protected_blocks)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            logger.warning("request %s: reserving %d slot(s) failed: %s", run.req_id, len(run.block_hashes), exc)
            return []
        written = []
        for block_id, block_hash, slot in zip(run.block_ids, run.block_hashes, slots):
            if slot >= 0:
                layout.read_block(block_id, out=tier.slot(slot))
                written.append(block_hash)
        return written

    def take_failed_block_ids(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM asks once per step)."""
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def close(self) -> None:
        if self._tier is not None:
            self._tier.close()
            self._tier = None

    def _require(self) -> tuple[PagedKVLayout, SharedTier]:
        if self._layout is None or self._tier is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self._layout, self._tier
