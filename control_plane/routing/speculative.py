"""Speculative index entries: where this replica just sent a prefix, before the engine's KV events say so.

After a route, the chosen engine will hold the prompt's blocks on its GPU as soon
as it has prefilled them, but its ``BlockStored`` events reach the block map
only later (publish interval + event delay). Back-to-back requests with the same
prefix would meanwhile see no holder and scatter. :class:`SpeculativeIndex`
remembers each routed prefix for ``ttl`` seconds (llm-d's and Dynamo's
"speculative"/"optimistic" entries); lookups merge it with the block map as GPU
holdings of the routed node. A speculative holding never makes a node a pull
source: the blocks are not in its CPU tier yet.

Threading model: plain methods, one event loop; per replica, in memory (bounded).
"""

from __future__ import annotations

import collections
from typing import Callable, Hashable

MAX_ENTRIES = 200_000
# Of which one owner's (a tenant's) routes may hold this many: past it, its own oldest go. Shared, one tenant routing
# 65,536-block prompts pushed every other tenant's entries out within a few routes (their back-to-back requests
# scattered).
MAX_ENTRIES_PER_OWNER = 50_000


class SpeculativeIndex:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl = ttl_s
        self._clock = clock
        self._expiry: dict[Hashable, dict[tuple[bytes, str], float]] = {}   # scope -> (hash, node) -> expiry
        # owner -> its entries in the order they were recorded (one scope belongs to one owner)
        self._order: dict[str, collections.deque[tuple[float, Hashable, tuple[bytes, str]]]] = {}
        self._size = 0  # entries in every owner's order

    def _drop_oldest(self, owner: str) -> None:
        order = self._order[owner]
        expiry, scope, key = order.popleft()
        self._size -= 1
        if not order:
            del self._order[owner]
        entries = self._expiry.get(scope, {})
        if entries.get(key) == expiry:
            del entries[key]
            if not entries:
                del self._expiry[scope]

    def _purge(self, now: float, owner: str) -> None:
        for name in list(self._order):
            while self._order.get(name) and self._order[name][0][0] <= now:
                self._drop_oldest(name)
        while owner in self._order and len(self._order[owner]) > MAX_ENTRIES_PER_OWNER:
            self._drop_oldest(owner)
        while self._size > MAX_ENTRIES:  # many owners: the largest gives up its oldest
            self._drop_oldest(max(self._order, key=lambda name: len(self._order[name])))

    def record(self, scope: Hashable, node_id: str, block_hashes: list[bytes], owner: str = "") -> None:
        """``node_id`` will hold ``block_hashes`` (a prefix) soon; ``owner``: whose entries they are (the tenant)."""
        if self._ttl <= 0 or not block_hashes:
            return
        now = self._clock()
        expiry = now + self._ttl
        entries = self._expiry.setdefault(scope, {})
        order = self._order.setdefault(owner, collections.deque())
        for h in block_hashes[:MAX_ENTRIES_PER_OWNER]:  # a prefix longer than the share: its leading blocks
            key = (h, node_id)
            entries[key] = expiry
            order.append((expiry, scope, key))
        self._size += min(len(block_hashes), MAX_ENTRIES_PER_OWNER)
        self._purge(now, owner)

    def leading_blocks(self, scope: Hashable, node_ids: list[str], block_hashes: list[bytes]) -> dict[str, int]:
        """Per node, how many leading ``block_hashes`` it was recently routed (0s left out). Each node is scanned
        once however often ``node_ids`` names it (candidates are engines, many may share a node)."""
        entries = self._expiry.get(scope)
        if not entries:
            return {}
        now = self._clock()
        out: dict[str, int] = {}
        for node in dict.fromkeys(node_ids):
            n = 0
            for h in block_hashes:
                expiry = entries.get((h, node))
                if expiry is None or expiry <= now:
                    break
                n += 1
            if n:
                out[node] = n
        return out
