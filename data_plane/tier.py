"""The CPU tier: block slots of the shared region and their lifecycle.

Lifecycle of a block (one slot), legal transitions only::

    (free) --reserve--> ALLOCATED --written--> WRITTEN --commit--> COMMITTED --evict--> (free)
                           |                     |
                           +------abort----------+------> (free)

* ALLOCATED: a writer (the local engine, or a pull) owns the slot and is
  filling it. Lookups see the block as HIT_PENDING.
* WRITTEN: the bytes are in place and checksummed, not yet visible.
* COMMITTED: visible to lookups. Evictable while unpinned; a block pinned by a
  reader (a peer's lease, the local engine's acquire) is never evicted.
* No transfer writes into a tier slot: a pull's bytes land in its source's landing
  arena and are copied in (data_plane.landing), so a failed pull's slots are aborted
  at once, whatever its transfer may still do.
* Fair share: a tenant's reservation evicts another tenant's blocks only while that tenant
  holds more than an equal share of the slots (data_plane.fair_share); its own it may
  always evict. With one tenant this is the policy's order alone.
* Purged: a committed block of a tenant epoch that ended (:meth:`MemoryTier.purge`), or
  one whose bytes changed after it was stored (:meth:`MemoryTier.discard`), leaves the
  index at once; its slot is free again once no reader pins it.

Threading model: not thread-safe. The data plane's event-loop thread is the
only caller; waiters use asyncio events of that loop.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from dataclasses import dataclass, field
from itertools import compress, count, filterfalse, islice, repeat
from operator import attrgetter, is_not
from typing import Callable, Iterable, Iterator

from kvmesh.errors import FailedPrecondition
from kvmesh.namespace import Namespace

from data_plane.eviction import BlockInfo, EvictionPolicy
from data_plane.fair_share import evictable_by
from data_plane.shm import SharedRegion
from data_plane.types import BlockKey

log = logging.getLogger(__name__)


class BlockState(enum.Enum):
    ALLOCATED = "allocated"
    WRITTEN = "written"
    COMMITTED = "committed"


@dataclass(eq=False, slots=True)
class Block:
    key: BlockKey
    namespace: Namespace
    slot: int
    info: BlockInfo
    state: BlockState = BlockState.ALLOCATED
    pins: int = 0
    checksum: int = 0
    epoch: str = ""  # the tenant epoch this node knew when the block was stored (data_plane.epochs)
    _settled: asyncio.Event | None = field(default=None, repr=False)

    @property
    def committed(self) -> bool:
        return self.state is BlockState.COMMITTED


EvictHook = Callable[[list[Block]], None]
_PINS, _SLOT, _KEY, _STATE = attrgetter("pins"), attrgetter("slot"), attrgetter("key"), attrgetter("state")


class MemoryTier:
    """Slots of a :class:`SharedRegion`, indexed by :class:`BlockKey`.

    ``on_evict(blocks)`` runs before evicted blocks' slots are reused, while
    their bytes are still intact (the data plane demotes them to disk there).
    """

    def __init__(self, region: SharedRegion, policy: EvictionPolicy, on_evict: EvictHook) -> None:
        self.region = region
        self._policy = policy
        self._on_evict = on_evict
        self._blocks: dict[BlockKey, Block] = {}
        self._free = list(range(region.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._per_tenant: collections.Counter[str] = collections.Counter()  # slots held, by tenant
        self._purged_pinned: set[Block] = set()  # purged while pinned: out of the index, slot freed at unpin

    # ---- queries ----

    def get(self, key: BlockKey) -> Block | None:
        return self._blocks.get(key)

    def get_all(self, keys: Iterable[BlockKey]) -> list[Block | None]:
        """:meth:`get` of each key, in one native loop."""
        return list(map(self._blocks.get, keys))

    def committed(self) -> Iterator[Block]:
        return (b for b in self._blocks.values() if b.committed)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def __len__(self) -> int:
        return len(self._blocks)

    def tenant_slots(self, tenant: str) -> int:
        """Slots the tenant's blocks occupy (any state)."""
        return self._per_tenant[tenant]

    def tenants(self) -> set[str]:
        """Tenants with blocks in the index."""
        return {t for t, n in self._per_tenant.items() if n > 0}

    # ---- transitions ----

    def reserve(self, namespace: Namespace, key: BlockKey, info: BlockInfo, epoch: str = "") -> Block | None:
        """A new ALLOCATED block tagged ``epoch``, evicting if needed; None when the key exists or nothing is
        evictable."""
        if key in self._blocks:
            return None
        if not self._free and not self._evict(1, namespace.tenant):
            return None
        block = Block(key, namespace, self._free.pop(), info, epoch=epoch)
        self._blocks[key] = block
        self._per_tenant[namespace.tenant] += 1
        return block

    def reserve_run(self, namespace: Namespace, keys: list[BlockKey], infos: list[BlockInfo],
                    epoch: str = "") -> list[Block]:
        """:meth:`reserve` of the leading ``keys`` up to the first one that exists or finds no slot, with the
        evictions they need done in one pass of the policy."""
        blocks = self._blocks
        n = next(compress(count(), map(blocks.__contains__, keys)), len(keys))
        if n > len(self._free):
            self._evict(n - len(self._free), namespace.tenant)
        free, tenant = self._free, namespace.tenant
        k = min(n, len(free))
        # the slots in ascending order: freed runs (a victim run comes back oldest first) stay runs, so the
        # pull's transfer and checks take one descriptor and one CRC call per run, not one per block
        slots = sorted(free[len(free) - k:])
        del free[len(free) - k:]
        out = [Block(key, namespace, slot, info, epoch=epoch) for key, slot, info in zip(keys, slots, infos)]
        blocks.update(zip(keys, out))
        self._per_tenant[tenant] += len(out)
        return out

    def _evict(self, n: int, tenant: str) -> int:
        """Evicts up to ``n`` unpinned blocks for ``tenant``: the policy's first victims it may evict (its
        own, or of a tenant over its fair share); how many."""
        # the policy's first n unpinned blocks, found in a native loop
        candidates = filterfalse(_PINS, map(self._blocks.__getitem__, self._policy.victims()))
        candidates = evictable_by(candidates, tenant, self._per_tenant, self.region.num_slots)
        victims = list(islice(candidates, n))
        if not victims:
            return 0
        self._policy.remove_all(map(_KEY, victims), evicted=True)
        self._on_evict(victims)
        blocks, per_tenant = self._blocks, self._per_tenant
        for victim in victims:
            del blocks[victim.key]
            per_tenant[victim.namespace.tenant] -= 1
        self._free.extend(map(_SLOT, victims))
        return len(victims)

    def mark_written(self, block: Block, checksum: int) -> None:
        self._expect(block, BlockState.ALLOCATED)
        block.checksum = checksum
        block.state = BlockState.WRITTEN

    def commit(self, block: Block) -> None:
        self._expect(block, BlockState.WRITTEN)
        block.state = BlockState.COMMITTED
        self._policy.insert(block.key, block.info)
        self._settle(block)

    def commit_written(self, blocks: list[Block], checksums) -> None:
        """:meth:`mark_written` then :meth:`commit`, for ALLOCATED blocks whose bytes arrived (a pull's)."""
        allocated, committed = BlockState.ALLOCATED, BlockState.COMMITTED
        wrong = next(compress(blocks, map(is_not, map(_STATE, blocks), repeat(allocated))), None)
        if wrong is not None:  # checked before any block changes: all or nothing
            self._expect(wrong, allocated)
        for block, crc in zip(blocks, checksums):
            block.checksum = int(crc)
            block.state = committed
            if block._settled is not None:
                block._settled.set()
        self._policy.insert_all(map(_KEY, blocks), map(attrgetter("info"), blocks))

    def abort(self, block: Block) -> None:
        """Frees an uncommitted block's slot."""
        if block.committed:
            raise FailedPrecondition(f"block {block.key.block_hash.hex()} is committed; it cannot be aborted")
        self._drop(block)
        self._free.append(block.slot)

    def _drop(self, block: Block) -> None:
        if self._blocks.get(block.key) is block:
            del self._blocks[block.key]
            self._per_tenant[block.namespace.tenant] -= 1
        self._settle(block)

    def purge(self, tenant: str, keep: str | None) -> list[Block]:
        """Drops the tenant's committed blocks not tagged ``keep`` (None: all of them) from the index; an
        unpinned one's slot is free at once, a pinned one's when its last reader unpins it. Uncommitted
        blocks are left to their writer (a commit checks the epoch). Returns the blocks dropped."""
        gone = [b for b in self._blocks.values()
                if b.namespace.tenant == tenant and b.committed and b.epoch != keep]
        for block in gone:
            self.discard(block)
        return gone

    def discard(self, block: Block) -> bool:
        """Drops a committed block from the index (its epoch ended, or its bytes changed); its slot is free at
        once when unpinned, else when its last reader unpins it. False when it was no longer indexed."""
        if not block.committed or self._blocks.get(block.key) is not block:
            return False
        self._policy.remove(block.key, evicted=False)
        del self._blocks[block.key]
        self._per_tenant[block.namespace.tenant] -= 1
        if block.pins:
            self._purged_pinned.add(block)
        else:
            self._free.append(block.slot)
        return True

    def peer_pin_share(self) -> int:
        """The most of one tenant's blocks one peer may hold pinned here: an equal share of the slots between
        the tenants holding blocks, and never more than half (a newcomer's fair share). Within it, every tenant
        over its share keeps unpinned blocks a newcomer may evict (data_plane.fair_share)."""
        return self.region.num_slots // max(2, sum(1 for n in self._per_tenant.values() if n > 0))

    def pin(self, block: Block) -> None:
        self._expect(block, BlockState.COMMITTED)
        block.pins += 1
        self._policy.touch(block.key)

    def pin_all(self, blocks: list[Block]) -> None:
        """:meth:`pin` of committed blocks (a Lookup's HITs) in one call."""
        committed = BlockState.COMMITTED
        for block in blocks:
            if block.state is not committed:
                self._expect(block, committed)
        self._policy.touch_all(map(_KEY, blocks))  # first: a block it does not track raises before any pin
        for block in blocks:
            block.pins += 1

    def unpin(self, block: Block) -> None:
        if block.pins <= 0:
            raise FailedPrecondition(f"block {block.key.block_hash.hex()} is not pinned")
        block.pins -= 1
        if block.pins == 0 and block in self._purged_pinned:
            self._purged_pinned.discard(block)
            self._free.append(block.slot)

    def unpin_all(self, blocks: list[Block]) -> None:
        """:meth:`unpin` of each block, in one call."""
        purged = self._purged_pinned
        for block in blocks:
            if block.pins <= 0 or purged:
                self.unpin(block)  # the error, or a purged block's slot to free
            else:
                block.pins -= 1

    # ---- waiting for a pending block ----

    async def wait_settled(self, block: Block, timeout: float) -> bool:
        """Waits until an uncommitted block is committed or dropped; True if committed in time."""
        if block.state is not BlockState.COMMITTED and self._blocks.get(block.key) is block:
            if block._settled is None:
                block._settled = asyncio.Event()
            try:
                await asyncio.wait_for(block._settled.wait(), timeout)
            except TimeoutError:
                return False
        return block.committed and self._blocks.get(block.key) is block

    @staticmethod
    def _settle(block: Block) -> None:
        if block._settled is not None:
            block._settled.set()

    @staticmethod
    def _expect(block: Block, state: BlockState) -> None:
        if block.state is not state:
            raise FailedPrecondition(
                f"block {block.key.block_hash.hex()} is {block.state.value}, expected {state.value}"
            )
