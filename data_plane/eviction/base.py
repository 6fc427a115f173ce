"""The eviction-policy contract.

Implementor contracts:
  * A policy tracks exactly the keys inserted and not yet removed; it never
    yields a key it does not track, and yields each tracked key at most once
    per :meth:`EvictionPolicy.victims` iteration.
  * It only orders keys; the tier decides. The tier iterates ``victims()``,
    skips keys it cannot evict right now (pinned by a reader), stops once it
    has as many keys as it needs to evict and calls ``remove(key, evicted=True)``
    for each after leaving the iteration. Mutating the policy during an iteration ends it.
  * ``insert`` is only called for keys not tracked; ``touch`` and ``remove``
    only for tracked keys.
  * Policies are constructed with the tier's capacity (in blocks): a hint for
    bounded history (ARC's ghost lists); they never refuse an insert.

Threading model: not thread-safe. The tier owns its policy and calls it from
the data plane's event-loop thread only.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a policy may know about a block when it arrives."""

    cost: float = 1.0  # relative cost to recompute it (grows with its position in the chain)
    protected: bool = False  # part of a protected prefix (e.g. a shared system prompt)


# Prefill cost of a block relative to the first one grows with its position (attention over a longer context); used
# by the cost-aware policy.
ATTENTION_COST_PER_BLOCK = 0.05


@functools.lru_cache(maxsize=1 << 16)
def block_info(position: int, protected: bool = False) -> BlockInfo:
    """What a policy is told about the block at ``position`` (0-based) of its chain (one shared, immutable
    record per position: a pull of 1,000 blocks builds none after the first)."""
    return BlockInfo(cost=1.0 + position * ATTENTION_COST_PER_BLOCK, protected=protected)


class EvictionPolicy(abc.ABC):
    """Orders a tier's resident blocks for eviction."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity

    @abc.abstractmethod
    def insert(self, key: Hashable, info: BlockInfo) -> None:
        """``key`` became resident."""

    @abc.abstractmethod
    def touch(self, key: Hashable) -> None:
        """``key`` was read (a hit)."""

    @abc.abstractmethod
    def remove(self, key: Hashable, *, evicted: bool) -> None:
        """``key`` left the tier: chosen as a victim (``evicted``) or dropped for another reason."""

    @abc.abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Tracked keys, the best victim first."""

    # Batches (a pull's run of blocks): the same as one call per key, in order; a policy may do them in one
    # native loop.

    def insert_all(self, keys: Iterable[Hashable], infos: Iterable[BlockInfo]) -> None:
        for key, info in zip(keys, infos):
            self.insert(key, info)

    def touch_all(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.touch(key)

    def remove_all(self, keys: Iterable[Hashable], *, evicted: bool) -> None:
        for key in keys:
            self.remove(key, evicted=evicted)

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, key: Hashable) -> bool: ...
