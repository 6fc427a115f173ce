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
        if not heap:
            return
        yield heap[0][3]
        rest = [e for e in heap[1:] if self._live(e)]
        heapq.heapify(rest)
        while rest:
            yield heapq.heappop(rest)[3]

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entry
