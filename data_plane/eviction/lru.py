"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from data_plane.eviction.base import BlockInfo, EvictionPolicy


class LruPolicy(EvictionPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def insert(self, key: Hashable, info: BlockInfo) -> None:
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Hashable, *, evicted: bool) -> None:
        del self._order[key]

    def victims(self) -> Iterator[Hashable]:
        yield from self._order

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order
