"""Pulls this replica has routed and that are still (by its estimate) on the wire.

A source NIC serves the pulls routed to it one after another, and so does the
puller's NIC: the tenth pull routed from a popular holder waits for nine. The
measured link bandwidth says how fast one pull goes, not how many are queued, so
the router keeps its own ledger: every routed pull occupies the source's and the
destination's NIC for ``bytes / bandwidth`` from when both are free, but not before
the destination engine reaches the request (its estimated queue: an engine starts
a pull when its scheduler first examines the request). The cost model adds the
wait to a pull's transfer time. Only routes this replica
made are known; the ledger forgets a node once its pulls should have finished.

Threading model: plain methods, one event loop; per replica, in memory.
"""

from __future__ import annotations

from typing import Callable


class PullLedger:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._free_at: dict[str, float] = {}   # node id -> when its NIC is free of routed pulls (clock seconds)

    def wait_s(self, source_node: str, dest_node: str, after_s: float = 0.0) -> float:
        """How long a pull from ``source_node`` into ``dest_node`` that starts ``after_s`` from now waits for the
        pulls routed before it."""
        start = self._clock() + after_s
        return max(0.0, self._free_at.get(source_node, start) - start, self._free_at.get(dest_node, start) - start)

    def add(self, source_node: str, dest_node: str, seconds: float, after_s: float = 0.0) -> None:
        """A pull of ``seconds`` on the wire, starting ``after_s`` from now at the earliest, was routed now."""
        now = self._clock()
        start = now + after_s + self.wait_s(source_node, dest_node, after_s)
        self._free_at[source_node] = max(self._free_at.get(source_node, 0.0), start + seconds)
        self._free_at[dest_node] = max(self._free_at.get(dest_node, 0.0), start + seconds)
        if len(self._free_at) > 10_000:
            self._free_at = {k: v for k, v in self._free_at.items() if v > now}
