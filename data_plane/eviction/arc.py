"""Adaptive Replacement Cache (Megiddo & Modha, FAST '03), adapted to an external evictor.

T1 holds keys seen once recently, T2 keys seen at least twice; B1 and B2 are
ghost lists of keys recently evicted from T1 and T2. A re-inserted ghost
moves the target size ``p`` of T1 towards the list that would have kept it.
Victims come from T1 while it is above its target, else from T2.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from data_plane.eviction.base import BlockInfo, EvictionPolicy


class ArcPolicy(EvictionPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._p = 0.0

    def insert(self, key: Hashable, info: BlockInfo) -> None:
        if key in self._b1:
            self._p = min(float(self.capacity), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        if key in self._t1:
            del self._t1[key]
            ghosts = self._b1
        else:
            del self._t2[key]
            ghosts = self._b2
        if evicted:
            ghosts[key] = None
            self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def victims(self) -> Iterator[Hashable]:
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            yield from self._t1
            yield from self._t2
        else:
            yield from self._t2
            yield from self._t1

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._t1 or key in self._t2
