"""Cost-aware eviction: keep what is expensive to recompute and likely reused.

GreedyDual-Size-Frequency with uniform sizes: a block's priority is
``L + hits * cost`` where ``cost`` is its recompute cost (deeper blocks of a
chain cost more to prefill: attention over a longer context) and ``L`` is the
priority of the last victim, which ages blocks that stop being hit. Blocks of
a protected prefix (a shared system prompt) are only evicted when nothing
unprotected can be.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Hashable, Iterator

from data_plane.eviction.base import BlockInfo, EvictionPolicy


class CostAwarePolicy(EvictionPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._info: dict[Hashable, BlockInfo] = {}
        self._hits: dict[Hashable, int] = {}
        self._entry: dict[Hashable, tuple] = {}  # key -> its live heap entry
        self._heap: list[tuple] = []  # (protected, priority, seq, key); stale entries skipped
        self._seq = itertools.count()
        self._age = 0.0  # L

    def _push(self, key: Hashable) -> None:
        info = self._info[key]
        entry = (info.protected, self._age + self._hits[key] * info.cost, next(self._seq), key)
        self._entry[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._entry) + 64:  # bound the stale entries
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)

    def insert(self, key: Hashable, info: BlockInfo) -> None:
        self._info[key] = info
        self._hits[key] = 1
        self._push(key)

    def touch(self, key: Hashable) -> None:
        self._hits[key] += 1
        self._push(key)

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        entry = self._entry.pop(key)
        del self._info[key], self._hits[key]
        if evicted:
            self._age = max(self._age, entry[1])

    def _live(self, entry: tuple) -> bool:
        return self._entry.get(entry[3]) is entry

    def victims(self) -> Iterator[Hashable]:
        heap = self._heap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        # The heap in order without copying it: a frontier of the nodes whose parents were yielded, smallest first
        # (k victims cost O(k log k); the copy and heapify of the rest cost O(tier) for a second one, 20 ms on
        # 65,536 slots, and a fair-share pass asks for many). The heap must not change while this is consumed.
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            entry, i = heapq.heappop(frontier)
            if self._live(entry):
                yield entry[3]
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entry
