"""Pulls this replica has routed and that are still (by its estimate) on the wire.

A source NIC serves the pulls routed to it one after another, and so does the
puller's NIC: the tenth pull routed from a popular holder waits for nine. The
measured link bandwidth says how fast one pull goes, not how many are queued, so
the router keeps its own ledger: every routed pull occupies the source's and the
destination's NIC from ``max(now, both free)`` for ``bytes / bandwidth``. The
cost model adds the wait to a pull's transfer time. Only routes this replica
made are known; the ledger forgets a node once its pulls should have finished.

Threading model: plain methods, one event loop; per replica, in memory.
"""

from __future__ import annotations

from typing import Callable


class PullLedger:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._free_at: dict[str, float] = {}   # node id -> when its NIC is free of routed pulls (clock seconds)

    def wait_s(self, source_node: str, dest_node: str) -> float:
        """How long a pull from ``source_node`` into ``dest_node`` routed now waits for earlier ones."""
        now = self._clock()
        return max(0.0, self._free_at.get(source_node, now) - now, self._free_at.get(dest_node, now) - now)

    def add(self, source_node: str, dest_node: str, seconds: float) -> None:
        """A pull of ``seconds`` on the wire was routed now."""
        now = self._clock()
        start = now + self.wait_s(source_node, dest_node)
        self._free_at[source_node] = self._free_at[dest_node] = start + seconds
        if len(self._free_at) > 10_000:
            self._free_at = {k: v for k, v in self._free_at.items() if v > now}
