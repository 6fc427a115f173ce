"""The disk tier: fixed-size block slots in one preallocated file on local disk.

Blocks evicted from the CPU tier are written here (``pwrite`` from the shared
region) and promoted back (``preadv`` straight into a CPU slot) on a hit. The
index lives in memory with each block's CRC-32C, checked on every promotion: a
corrupt block is dropped and reported as a miss. The file is scratch space,
removed at shutdown; a restarted node starts with an empty disk tier. A block
evicts another tenant's only while that tenant is over its fair share
(data_plane.fair_share), as in the CPU tier.

Threading model: not thread-safe; called from the data plane's event-loop
thread. Reads and writes are synchronous (one block at a time, page cache).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Iterator

import numpy as np

from kvmesh.namespace import Namespace

from data_plane.checksum import checksum
from data_plane.eviction import BlockInfo, EvictionPolicy
from data_plane.fair_share import evictable_by
from data_plane.files import create_exclusive
from data_plane.types import BlockKey

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DiskBlock:
    key: BlockKey
    namespace: Namespace
    slot: int
    checksum: int
    info: BlockInfo
    epoch: str = ""  # the tenant epoch of the CPU block it was demoted from (data_plane.epochs)


class DiskTier:
    def __init__(self, path: Path, block_bytes: int, num_slots: int, policy: EvictionPolicy) -> None:
        self.path = Path(path)
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self._policy = policy
        self._blocks: dict[BlockKey, DiskBlock] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._per_tenant: collections.Counter[str] = collections.Counter()  # blocks held, by tenant
        self._held: set[BlockKey] = set()  # not evicted while held (being promoted)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Scratch space: a file this user left behind (a crash) is replaced; anything else refused.
        self._fd = create_exclusive(self.path, stale=lambda _path: True)
        os.ftruncate(self._fd, block_bytes * num_slots)

    def get(self, key: BlockKey) -> DiskBlock | None:
        return self._blocks.get(key)

    @contextlib.contextmanager
    def held(self, key: BlockKey) -> Iterator[None]:
        """``key`` is not evicted meanwhile (a promotion's reservation may evict a CPU block to this full disk, and
        took the very block it was promoting: the read failed and left its CPU slot reserved for good)."""
        self._held.add(key)
        try:
            yield
        finally:
            self._held.discard(key)

    def blocks(self) -> Iterator[DiskBlock]:
        return iter(self._blocks.values())

    def __len__(self) -> int:
        return len(self._blocks)

    def tenants(self) -> set[str]:
        """Tenants with blocks here."""
        return {t for t, n in self._per_tenant.items() if n > 0}

    def write(self, namespace: Namespace, key: BlockKey, data: np.ndarray, checksum: int,
              info: BlockInfo, epoch: str = "") -> list[DiskBlock] | None:
        """Stores a block (no-op if present); returns the blocks evicted to make room, None when there is none
        for its tenant (every block another tenant's, each within its fair share: nothing stored)."""
        if key in self._blocks:
            return []
        evicted = []
        if not self._free:
            candidates = evictable_by((self._blocks[k] for k in self._policy.victims() if k not in self._held),
                                      namespace.tenant, self._per_tenant, self.num_slots)
            victim_key = next(map(attrgetter("key"), candidates), None)
            if victim_key is None:
                return None
            victim = self._blocks.pop(victim_key)
            self._per_tenant[victim.namespace.tenant] -= 1
            self._policy.remove(victim.key, evicted=True)
            self._free.append(victim.slot)
            evicted.append(victim)
        slot = self._free.pop()
        written = os.pwrite(self._fd, memoryview(data), slot * self.block_bytes)
        if written != self.block_bytes:
            self._free.append(slot)
            raise OSError(f"short write to {self.path}: {written} of {self.block_bytes} bytes")
        self._blocks[key] = DiskBlock(key, namespace, slot, checksum, info, epoch)
        self._per_tenant[namespace.tenant] += 1
        self._policy.insert(key, info)
        return evicted

    def read_into(self, key: BlockKey, out: np.ndarray) -> DiskBlock | None:
        """Copies a block into ``out`` and verifies it; None if it is not here, or corrupt (then dropped)."""
        block = self._blocks.get(key)
        if block is None:
            return None
        read = os.preadv(self._fd, [memoryview(out)], block.slot * self.block_bytes)
        if read != self.block_bytes or checksum(out) != block.checksum:
            log.error("disk block %s failed verification; dropped", key.block_hash.hex())
            self.remove(key)
            return None
        self._policy.touch(key)
        return block

    def remove(self, key: BlockKey) -> DiskBlock:
        block = self._blocks.pop(key)
        self._per_tenant[block.namespace.tenant] -= 1
        self._policy.remove(key, evicted=False)
        self._free.append(block.slot)
        return block

    def purge(self, tenant: str, keep: str | None) -> list[DiskBlock]:
        """Removes the tenant's blocks not tagged ``keep`` (None: all of them); returns them."""
        gone = [b for b in self._blocks.values() if b.namespace.tenant == tenant and b.epoch != keep]
        for block in gone:
            self.remove(block.key)
        return gone

    def close(self) -> None:
        os.close(self._fd)
        self.path.unlink(missing_ok=True)
