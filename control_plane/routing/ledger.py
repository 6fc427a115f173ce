"""Pulls this replica has routed and that are still (by its estimate) on the wire.

A source NIC serves the pulls routed to it, and so do the puller's NIC and, between
zones (racks), the uplink from the source's zone to the puller's: the tenth pull
routed from a popular holder, or across a busy uplink, waits for the nine before it
(fair sharing finishes the same bytes no sooner). The measured link bandwidth says
how fast one pull goes, not how many share the way, so the router keeps its own
ledger: every routed pull occupies each link on its path (source NIC out,
destination NIC in, the zones' uplink) for ``bytes / bandwidth`` from when all are
free, but not before the destination engine reaches the request (its estimated
queue: an engine starts a pull when its scheduler first examines the request). The
cost model adds the wait to a pull's transfer time. Only routes this replica made
are known; the ledger forgets a link once its pulls should have finished.

A route's pull size and queue are figures its caller gives (candidates' backlogs, KV
bytes per token), and the ledger is every tenant's: it books no link further than
``MAX_AHEAD_S`` ahead. Unbounded, one Route naming a made-up candidate with a huge
backlog booked the source's NIC for 10^14 s, and every tenant's pull from it was
``RECOMPUTE_CHEAPER`` until the control plane restarted.

Threading model: plain methods, one event loop; per replica, in memory.
"""

from __future__ import annotations

from typing import Callable, Hashable

MAX_AHEAD_S = 30.0  # no link is booked further ahead (a pull waiting longer is better recomputed anyway)


class PullLedger:
    def __init__(self, clock: Callable[[], float], zone_of: Callable[[str], str] | None = None) -> None:
        """``zone_of``: a node's zone; pulls between two zones share that direction's uplink (None: NICs only)."""
        self._clock = clock
        self._zone_of = zone_of
        self._free_at: dict[Hashable, float] = {}   # link -> when it is free of routed pulls (clock seconds)

    def _links(self, source_node: str, dest_node: str) -> list[Hashable]:
        links: list[Hashable] = [("out", source_node), ("in", dest_node)]
        if self._zone_of is not None:
            source_zone, dest_zone = self._zone_of(source_node), self._zone_of(dest_node)
            if source_zone != dest_zone:
                links.append(("up", source_zone, dest_zone))
        return links

    def wait_s(self, source_node: str, dest_node: str, after_s: float = 0.0) -> float:
        """How long a pull from ``source_node`` into ``dest_node`` that starts ``after_s`` from now waits for the
        pulls routed before it on any link of its path."""
        start = self._clock() + after_s
        return max([0.0] + [self._free_at.get(link, start) - start for link in self._links(source_node, dest_node)])

    def add(self, source_node: str, dest_node: str, seconds: float, after_s: float = 0.0) -> None:
        """A pull of ``seconds`` on the wire, starting ``after_s`` from now at the earliest, was routed now."""
        now = self._clock()
        end = min(now + after_s + self.wait_s(source_node, dest_node, after_s) + seconds, now + MAX_AHEAD_S)
        for link in self._links(source_node, dest_node):
            self._free_at[link] = max(self._free_at.get(link, 0.0), end)
        if len(self._free_at) > 10_000:
            self._free_at = {k: v for k, v in self._free_at.items() if v > now}
