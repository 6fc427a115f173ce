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

A link serves the pulls of different bookers (a tenant's schedulers, one node key) side by
side, as flows share a NIC: a pull waits in full for the pulls its own booker routed
before it, and for each other booker's at most as long as its own wait and transfer
(while both last, each has at least an equal share). So one booker at most doubles
another's estimate, however much it books: a route's pull size and queue are figures
its caller gives (candidates' backlogs, KV bytes per token), and when one booker's
bookings delayed every other's in full, one scheduler routing made-up backlogs kept
every tenant's pulls from the nodes it named ``RECOMPUTE_CHEAPER``. No link is booked
further than ``MAX_AHEAD_S`` ahead either (unbounded, one made-up backlog of 2^62
tokens booked a source's NIC for 10^14 s).

Threading model: plain methods, one event loop; per replica, in memory.
"""

from __future__ import annotations

from typing import Callable, Hashable

MAX_AHEAD_S = 30.0  # no link is booked further ahead (a pull waiting longer is better recomputed anyway)
# Links past which finished bookings are dropped. Destinations are candidates' node ids, which a route's caller
# names: with more live links than this, each route rebuilt the whole ledger (O(links) a route).
PRUNE_PAST_LINKS = 10_000


class PullLedger:
    def __init__(self, clock: Callable[[], float], zone_of: Callable[[str], str] | None = None) -> None:
        """``zone_of``: a node's zone; pulls between two zones share that direction's uplink (None: NICs only)."""
        self._clock = clock
        self._zone_of = zone_of
        # link -> booker -> when the pulls that booker routed over the link are done (clock seconds)
        self._free_at: dict[Hashable, dict[Hashable, float]] = {}
        self._prune_past = PRUNE_PAST_LINKS

    def _links(self, source_node: str, dest_node: str) -> list[Hashable]:
        links: list[Hashable] = [("out", source_node), ("in", dest_node)]
        if self._zone_of is not None:
            source_zone, dest_zone = self._zone_of(source_node), self._zone_of(dest_node)
            if source_zone != dest_zone:
                links.append(("up", source_zone, dest_zone))
        return links

    def wait_s(self, source_node: str, dest_node: str, after_s: float = 0.0, seconds: float = 0.0,
               booker: Hashable = None) -> float:
        """How long a pull of ``seconds`` on the wire from ``source_node`` into ``dest_node``, starting ``after_s``
        from now and routed for ``booker``, waits for the pulls routed before it on the busiest link of its path."""
        start = self._clock() + after_s
        worst = 0.0
        for link in self._links(source_node, dest_node):
            bookings = self._free_at.get(link, {})
            own = max(0.0, bookings.get(booker, start) - start)
            others = sum(min(end - start, own + seconds) for who, end in bookings.items()
                         if who != booker and end > start)
            worst = max(worst, own + others)
        return worst

    def add(self, source_node: str, dest_node: str, seconds: float, after_s: float = 0.0,
            booker: Hashable = None) -> None:
        """A pull of ``seconds`` on the wire, starting ``after_s`` from now at the earliest, was routed now for
        ``booker``."""
        now = self._clock()
        wait = self.wait_s(source_node, dest_node, after_s, seconds, booker)
        end = min(now + after_s + wait + seconds, now + MAX_AHEAD_S)
        for link in self._links(source_node, dest_node):
            bookings = self._free_at.setdefault(link, {})
            bookings[booker] = max(bookings.get(booker, 0.0), end)
        if len(self._free_at) > self._prune_past:  # amortised: pruned again only once the live links doubled
            self._free_at = {link: live for link, bookings in self._free_at.items()
                             if (live := {who: end for who, end in bookings.items() if end > now})}
            self._prune_past = max(PRUNE_PAST_LINKS, 2 * len(self._free_at))
