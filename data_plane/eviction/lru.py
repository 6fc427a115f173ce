"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Hashable, Iterable, Iterator

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
        return iter(self._order)

    def insert_all(self, keys: Iterable[Hashable], infos: Iterable[BlockInfo]) -> None:
        self._order.update(dict.fromkeys(keys))

    def touch_all(self, keys: Iterable[Hashable]) -> None:
        deque(map(self._order.move_to_end, keys), maxlen=0)

    def remove_all(self, keys: Iterable[Hashable], *, evicted: bool) -> None:
        deque(map(self._order.__delitem__, keys), maxlen=0)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order
