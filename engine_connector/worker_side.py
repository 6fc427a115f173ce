"""Worker half of the connector: copies blocks between the store and vLLM's paged KV cache.

Runs in the process that owns the KV cache, on the model runner's thread. Everything is
synchronous: loads finish in ``start_load_kv`` before the forward, saves in
``wait_for_save`` after it (the CPU forward has completed by then, so every layer's KV of
the step is in the cache and per-layer ``save_kv_layer`` hooks are unnecessary).

A failed load is reported through ``take_failed_block_ids`` and vLLM recomputes from the
first failed block. The saves of a step with failed loads are dropped: tokens computed in
that step attended to the unloaded blocks, so their KV must not be published.
"""

from __future__ import annotations

import logging
import time

import torch

from engine_connector.block_store import BlockReadError, BlockStore
from engine_connector.kv_layout import PagedKVLayout
from engine_connector.metadata import KvmeshConnectorMetadata

logger = logging.getLogger(__name__)


class WorkerSide:
    """Executes one step's :class:`KvmeshConnectorMetadata`; see the module docstring."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store
        self._layout: PagedKVLayout | None = None
        self._failed_block_ids: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's per-layer caches; their block size must match the store's."""
        layout = PagedKVLayout(kv_caches)
        if layout.block_nbytes != self._store.block_nbytes:
            raise ValueError(
                f"engine KV blocks are {layout.block_nbytes} bytes, the store's are {self._store.block_nbytes}"
            )
        self._layout = layout

    def load(self, meta: KvmeshConnectorMetadata) -> None:
        """Copy ``meta.loads`` into the cache; remember the blocks that could not be read."""
        if not meta.loads:
            return
        layout = self._require_layout()
        started = time.perf_counter()
        failures: dict[str, list[str]] = {}
        for transfer in meta.loads:
            try:
                layout.write_block(transfer.block_id, self._store.read(transfer.block_hash))
            except BlockReadError as exc:
                self._failed_block_ids.add(transfer.block_id)
                failures.setdefault(transfer.req_id, []).append(str(exc))
        for req_id, errors in failures.items():
            logger.warning("request %s: %d block load(s) failed, first: %s", req_id, len(errors), errors[0])
        logger.info(
            "loaded %d of %d block(s) in %.1f ms",
            len(meta.loads) - sum(map(len, failures.values())),
            len(meta.loads),
            (time.perf_counter() - started) * 1e3,
        )

    def save(self, meta: KvmeshConnectorMetadata) -> None:
        """Copy ``meta.saves`` out of the cache and commit them, unless this step's loads failed."""
        if not meta.saves:
            return
        if self._failed_block_ids:
            logger.warning("dropping %d block save(s) of a step with failed loads", len(meta.saves))
            return
        layout = self._require_layout()
        started = time.perf_counter()
        for transfer in meta.saves:
            self._store.write(transfer.block_hash, layout.read_block(transfer.block_id))
        self._store.commit()
        logger.info("saved %d block(s) in %.1f ms", len(meta.saves), (time.perf_counter() - started) * 1e3)

    def take_failed_block_ids(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM asks once per step)."""
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def _require_layout(self) -> PagedKVLayout:
        if self._layout is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self._layout
