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


class SpeculativeIndex:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl = ttl_s
        self._clock = clock
        self._expiry: dict[Hashable, dict[tuple[bytes, str], float]] = {}   # scope -> (hash, node) -> expiry
        self._order: collections.deque[tuple[float, Hashable, tuple[bytes, str]]] = collections.deque()

    def _purge(self, now: float) -> None:
        while self._order and (self._order[0][0] <= now or len(self._order) > MAX_ENTRIES):
            expiry, scope, key = self._order.popleft()
            entries = self._expiry.get(scope, {})
            if entries.get(key) == expiry:
                del entries[key]
                if not entries:
                    del self._expiry[scope]

    def record(self, scope: Hashable, node_id: str, block_hashes: list[bytes]) -> None:
        """``node_id`` will hold ``block_hashes`` (a prefix) soon."""
        if self._ttl <= 0:
            return
        now = self._clock()
        self._purge(now)
        expiry = now + self._ttl
        entries = self._expiry.setdefault(scope, {})
        for h in block_hashes:
            key = (h, node_id)
            entries[key] = expiry
            self._order.append((expiry, scope, key))

    def leading_blocks(self, scope: Hashable, node_ids: list[str], block_hashes: list[bytes]) -> dict[str, int]:
        """Per node, how many leading ``block_hashes`` it was recently routed (0s left out)."""
        entries = self._expiry.get(scope)
        if not entries:
            return {}
        now = self._clock()
        out: dict[str, int] = {}
        for node in node_ids:
            n = 0
            for h in block_hashes:
                expiry = entries.get((h, node))
                if expiry is None or expiry <= now:
                    break
                n += 1
            if n:
                out[node] = n
        return out
