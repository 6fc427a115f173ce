"""Where a source WRITEs on this node: one landing arena per source node, apart from the CPU tier.

A source WRITEs a pull's blocks one-sided into memory this node registered with NIXL, so it holds that
memory's NIXL metadata, and on the transports UCX has here (tcp, cma) whoever holds metadata can READ and
WRITE every address it describes, at any time, with stock NIXL (docs/security.md, "The landing arenas").
Handing a source the tier's metadata would let any node this node ever pulled from read every tenant's
blocks in the tier. So a source gets metadata for its own arena only (NIXL's partial metadata, which stock
NIXL refuses to address beyond), the blocks land there, and the pull copies each one into its tier slot
and checks the CRC-32C of the copy (:class:`~data_plane.checksum.RunChecker`): what is committed is what
was checked, in memory no peer was given. A source can see and change only its own arena, which holds only
bytes it sent itself.

An arena is anonymous memory of this process (pages are taken only when first written), ``slots`` blocks,
kept for the NIXL agent's life: stale metadata still reaches memory after NIXL deregistered it, so an arena is
never handed to another source, nor its memory reused. Its slots hold the blocks of a pull from that source
(written by the source, or READ from a ``serve_peer_reads`` one) until they are copied; those of a transfer that
failed and may still write are held longer (:mod:`data_plane.quarantine`), until the source proves it over, so
a failing source holds only its own arena's slots, never the tier's. A WRITE the source makes on its own into
slots given to a later pull of its can only make that pull's check fail: the check reads the copy, not the
arena.

Threading model: the node's event loop takes and gives back slots; the copies read :attr:`array` in worker
threads while the pull holds its slots.
"""

from __future__ import annotations

import mmap

import numpy as np


class LandingArena:
    """``slots`` landing slots of ``block_bytes`` for one source node's WRITEs."""

    def __init__(self, node_id: str, slots: int, block_bytes: int) -> None:
        self.node_id = node_id
        self.block_bytes = block_bytes
        self.slots = slots
        self._map = mmap.mmap(-1, slots * block_bytes)  # anonymous (MAP_SHARED, but never shared with a child)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.base_addr = self.array.ctypes.data
        self.size = slots * block_bytes
        self._free = np.ones(slots, dtype=bool)

    @property
    def free_slots(self) -> int:
        return int(np.count_nonzero(self._free))

    def take(self, n: int) -> np.ndarray:
        """Up to ``n`` free slots, lowest first (consecutive ones make one NIXL descriptor and one check)."""
        slots = np.flatnonzero(self._free)[:max(0, n)]
        self._free[slots] = False
        return slots

    def give_back(self, slots: np.ndarray) -> None:
        self._free[np.asarray(slots, dtype=np.int64)] = True

    def release_pages(self) -> None:
        """Gives the arena's pages back to the OS (it stays mapped: a late write faults a zeroed page in)."""
        self._map.madvise(mmap.MADV_REMOVE)  # the mapping is shared anonymous memory: DONTNEED would keep them

    def addrs(self, slots: np.ndarray) -> list[int]:
        """The address of each slot (where the source WRITEs)."""
        return (np.asarray(slots, dtype=np.uint64) * np.uint64(self.block_bytes)
                + np.uint64(self.base_addr)).tolist()
