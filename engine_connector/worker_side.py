"""Worker half of the connector: copies blocks between the node's shared-memory tier and vLLM's KV cache.

Runs in the process that owns the KV cache, on the model runner's thread. The node's CPU tier
is mapped into this process (``SharedTier``), so loads and saves are memory copies:

* loads (``start_load_kv``): the scheduler side already pulled and pinned the slots
  (``Acquire``) of requests waiting in ``WAITING_FOR_REMOTE_KVS``; their blocks are in no
  forward, so the step's slots are copied into their engine blocks, all requests at once (one
  gather/scatter per layer, :class:`PagedKVLayout`; on CPU at once, on a GPU queued on a side
  stream); once the copies of a step have landed its leases are released and its requests are
  reported through ``take_finished_loads`` (vLLM's ``finished_recving``);
* saves (``wait_for_save``, after the forward; on CPU every layer's KV of the step is then in
  the cache): ``Reserve`` slots for the step's newly full blocks (one RPC per request), one
  copy for the whole step, ``Commit`` (the data plane checksums and publishes them). ``-1``
  slots (already stored, beyond the request's offload cap, or no evictable slot) are skipped.

A failed copy is reported through ``take_failed_block_ids`` no later than its request's
``finished_recving`` and vLLM recomputes from the first failed block. The saves of a step with
failed loads are dropped (a conservative rule from the synchronous design: nothing computed
in this step attended to those blocks, but nothing is lost by waiting). A failed save RPC
loses only future hits; and since saves run inside the step (the forward waits), a data plane that does not
answer costs the step one RPC bound, not one per request: the step's other saves are skipped, and so are all
saves for a pause that doubles from ``SAVE_PAUSE_S`` to ``MAX_SAVE_PAUSE_S`` while it keeps failing (found in
review: with the node's data plane frozen every step waited ``rpc_timeout_s`` per request that filled a block).

``misplace_one_block`` (a negative-control hook, never for serving) writes, for every request
that loads two or more blocks, the middle block's bytes from the slot of the block before it:
the correctness checks must then fail.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from kvmesh.namespace import Namespace

from data_plane.client import SharedTier
from engine_connector.block_shape import EngineBlocks, SlotSizeMismatch
from engine_connector.kv_layout import PagedKVLayout
from engine_connector.metadata import BlockLoad, KvmeshConnectorMetadata, SaveRun
from engine_connector.node_link import NodeLink

logger = logging.getLogger(__name__)
SLOW_SAVE_MS = 500.0
SAVE_PAUSE_S = 1.0  # saves skipped this long after a save RPC failed, doubling while they keep failing
MAX_SAVE_PAUSE_S = 60.0


def _unanswered(exc: BaseException) -> bool:
    """The data plane did not answer (frozen, gone, overloaded), as opposed to refusing."""
    return isinstance(exc, TimeoutError) or exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                          grpc.StatusCode.UNAVAILABLE)


@dataclass(slots=True)
class _InFlight:
    """One step's queued copies: done when ``fence`` has landed."""

    req_ids: set[str]
    leases: list[str]
    fence: Any


class WorkerSide:
    def __init__(self, link: NodeLink, ns: Namespace, blocks: EngineBlocks, *,
                 misplace_one_block: bool = False, clock=time.monotonic) -> None:
        self._link = link
        self._clock = clock
        self._saves_resume_at = 0.0  # saves paused until then (clock seconds) after a save RPC failed
        self._save_pause_s = 0.0
        self._ns = ns
        self._blocks = blocks
        self._misplace = misplace_one_block
        self._tier: SharedTier | None = None
        self._layout: PagedKVLayout | None = None
        self._failed_block_ids: set[int] = set()
        self._in_flight: list[_InFlight] = []
        self._retired: list[SharedTier] = []  # mappings of a replaced tier, closed once no copy may read them

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's per-layer caches and map the node's tier; their block sizes must agree."""
        layout = PagedKVLayout(kv_caches)
        self._layout, self._tier = layout, self._map_tier(layout)

    def _map_tier(self, layout: PagedKVLayout) -> SharedTier:
        tier = SharedTier.open(self._link.describe_tier())
        try:
            self._blocks.check(self._link.data_plane_address, tier.block_bytes, layout.block_nbytes)
        except SlotSizeMismatch:
            tier.close()
            raise
        return tier

    def _current_tier(self) -> bool:
        """Whether the tier mapped here is the data plane's current one; if it was replaced (the data plane
        restarted: its new tier is a new file, and slot numbers it hands out are slots of that file), maps the new
        one for what comes next and answers False: slots this step was given may belong to either tier."""
        layout, tier = self._require()
        if not tier.replaced():
            return True
        try:
            fresh = self._map_tier(layout)
        except (grpc.aio.AioRpcError, TimeoutError, OSError, ValueError) as exc:  # the data plane is not back yet
            logger.warning("the data plane's CPU tier was replaced and the new one cannot be mapped yet (%s): this "
                           "step's loads recompute and its saves are skipped", exc)
            return False
        logger.warning("the data plane's CPU tier was replaced (the data plane restarted): mapped the new one; this "
                       "step's loads recompute")
        self._retired.append(tier)
        self._tier = fresh
        return False

    def load(self, meta: KvmeshConnectorMetadata) -> None:
        """Copy (or queue) ``meta.loads`` into the cache; remember blocks that could not be copied."""
        if not meta.loads:
            for lease in meta.leases:
                self._link.release(lease)
            return
        if not self._current_tier():  # never read a slot out of a tier it may not belong to
            self._failed_block_ids.update(load.block_id for load in meta.loads)
            self._in_flight.append(_InFlight({load.req_id for load in meta.loads}, [], self._require()[0].fence()))
            return  # the leases were the old data plane's: they ended with it
        layout, tier = self._require()
        started = time.perf_counter()
        loads = self._misplaced(meta.loads) if self._misplace else meta.loads
        copied = self._copy_in(layout, tier, loads)
        self._in_flight.append(_InFlight({load.req_id for load in loads}, list(meta.leases), layout.fence()))
        logger.info("%s %d of %d block(s) in %.1f ms", "queued" if layout.on_gpu else "loaded",
                    copied, len(loads), (time.perf_counter() - started) * 1e3)

    def _copy_in(self, layout: PagedKVLayout, tier: SharedTier, loads: list[BlockLoad]) -> int:
        """The step's slot -> block copies as one gather/scatter; a load whose block or slot is out of range fails
        alone, a failed copy fails every block of the step. Returns how many blocks were copied."""
        blocks = np.fromiter((load.block_id for load in loads), dtype=np.int64, count=len(loads))
        slots = np.fromiter((load.slot for load in loads), dtype=np.int64, count=len(loads))
        fits = (blocks >= 0) & (blocks < layout.num_blocks) & (slots >= 0) & (slots < tier.num_slots)
        for i in np.flatnonzero(~fits):
            self._failed_block_ids.add(int(blocks[i]))
            logger.warning("request %s: loading slot %d into block %d failed: outside the tier's %d slots or the "
                           "cache's %d blocks", loads[i].req_id, slots[i], blocks[i], tier.num_slots,
                           layout.num_blocks)
        try:
            layout.write_blocks(blocks[fits], tier.slots(), slots[fits])
        except (IndexError, ValueError, RuntimeError) as exc:
            self._failed_block_ids.update(blocks[fits].tolist())
            # str(exc): a logged exception would keep a view of the tier alive through its traceback.
            logger.warning("loading %d block(s) failed: %s", int(fits.sum()), str(exc))
            return 0
        return int(fits.sum())

    @staticmethod
    def _misplaced(loads: list[BlockLoad]) -> list[BlockLoad]:
        """The negative control: each request's middle block gets the slot of the block before it."""
        by_request: dict[str, list[int]] = {}
        for i, load in enumerate(loads):
            by_request.setdefault(load.req_id, []).append(i)
        out = list(loads)
        for positions in by_request.values():
            if len(positions) >= 2:
                k = positions[len(positions) // 2]
                out[k] = BlockLoad(loads[k].req_id, loads[k].block_id, loads[positions[len(positions) // 2 - 1]].slot)
                logger.warning("misplace_one_block: request %s block %d loaded from the wrong slot",
                               loads[k].req_id, loads[k].block_id)
        return out

    def take_finished_loads(self) -> set[str]:
        """Requests whose copies have landed since the last call; their leases are released."""
        done: set[str] = set()
        while self._in_flight and PagedKVLayout.landed(self._in_flight[0].fence):
            step = self._in_flight.pop(0)
            done |= step.req_ids
            for lease in step.leases:
                self._link.release(lease)
        if not self._in_flight:
            while self._retired:
                self._retired.pop().close()
        return done

    def save(self, meta: KvmeshConnectorMetadata) -> None:
        """Reserve, copy and commit ``meta.saves``, unless this step's loads failed."""
        if not meta.saves:
            return
        if self._failed_block_ids:
            logger.warning("dropping the saves of %d request(s): this step had failed loads", len(meta.saves))
            return
        if self._clock() < self._saves_resume_at:
            return  # the data plane did not answer a moment ago: this step does not wait for it
        if not self._current_tier() and self._require()[1].replaced():
            return  # no tier to write into: nothing is reserved
        layout, tier = self._require()
        started = time.perf_counter()
        block_ids: list[int] = []
        slots: list[int] = []
        written: list[bytes] = []
        for run in meta.saves:
            reserved = self._reserve(run)
            if reserved is None:  # the data plane did not answer: the step's other saves do not ask it again
                self._pause_saves(len(meta.saves))
                break
            for block_id, block_hash, slot in reserved:
                block_ids.append(block_id)
                slots.append(slot)
                written.append(block_hash)
        if not written:
            return
        try:  # one copy for the step; done (also on a GPU) before Commit checksums the slots
            layout.read_blocks(block_ids, tier.slots(), slots)
        except (IndexError, ValueError, RuntimeError) as exc:
            logger.warning("copying %d block(s) into their slots failed (%s); they stay unpublished", len(written),
                           str(exc))
            self._link.abort(self._ns, list(dict.fromkeys(written)))
            return
        try:
            self._link.commit(self._ns, list(dict.fromkeys(written)))
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            logger.warning("committing %d block(s) failed (%s); they stay unpublished", len(written), exc)
            self._link.abort(self._ns, list(dict.fromkeys(written)))
            if _unanswered(exc):
                self._pause_saves(len(meta.saves))
            return
        elapsed_ms = (time.perf_counter() - started) * 1e3
        # Saves run inside the step (the forward waits): a slow data plane shows here first.
        (logger.warning if elapsed_ms > SLOW_SAVE_MS else logger.info)(
            "saved %d block(s) of %d request(s) in %.1f ms", len(written), len(meta.saves), elapsed_ms)

    def _reserve(self, run: SaveRun) -> list[tuple[int, bytes, int]] | None:
        """(block id, hash, slot) of the run's blocks given a slot (``-1``: not to be stored); None when the
        data plane did not answer."""
        try:
            slots = self._link.reserve(self._ns, run.block_hashes, max_offload_tokens=run.max_offload_tokens,
                                       first_block_index=run.first_index, protected_blocks=run.protected_blocks)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            logger.warning("request %s: reserving %d slot(s) failed: %s", run.req_id, len(run.block_hashes), exc)
            return None if _unanswered(exc) else []  # a refusal (e.g. the tenant's limit) is an answer
        self._save_pause_s = 0.0
        return [(b, h, s) for b, h, s in zip(run.block_ids, run.block_hashes, slots) if s >= 0]

    def _pause_saves(self, requests: int) -> None:
        self._save_pause_s = min(MAX_SAVE_PAUSE_S, max(SAVE_PAUSE_S, 2 * self._save_pause_s))
        self._saves_resume_at = self._clock() + self._save_pause_s
        logger.warning("saves paused for %.0f s (this step's %d request(s) and every step's meanwhile): the data "
                       "plane did not answer, and the step waits for its saves", self._save_pause_s, requests)

    def take_failed_block_ids(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM asks once per step)."""
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def close(self) -> None:
        if self._layout is not None:
            self._layout.synchronize()
        if self._tier is not None:
            self._tier.close()
            self._tier = None
        while self._retired:
            self._retired.pop().close()

    def _require(self) -> tuple[PagedKVLayout, SharedTier]:
        if self._layout is None or self._tier is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self._layout, self._tier
