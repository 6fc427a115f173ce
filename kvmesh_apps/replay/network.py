"""Pulls on a shared network: every pull holds the source NIC, the destination NIC and, across racks, the
shared rack uplink, each a FIFO server of its own bandwidth.

A pull starts when every resource on its path is free and runs at the slowest
one's bandwidth; it then holds all of them until it ends (store-and-forward
serialisation: pessimistic for a pull that could share a link, exact for the
common case of one bottleneck). What the puller measures is the transfer alone,
``bytes / (end - start)``, apart from the wait: queueing is the ledger's and the
queue's business, not the link's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Transfer:
    start_ms: float
    end_ms: float
    nbytes: int

    @property
    def measured_bytes_per_s(self) -> float:
        return self.nbytes / max(1e-9, (self.end_ms - self.start_ms) / 1000.0)


class Network:
    def __init__(self, engines: int, racks: int, nic_bytes_per_s: float, uplink_bytes_per_s: float) -> None:
        self.rack = [i * racks // engines for i in range(engines)]
        self.nic_bps = nic_bytes_per_s
        self.uplink_bps = uplink_bytes_per_s
        self._free: dict[tuple, float] = {}

    def path(self, source: int, dest: int) -> tuple[list[tuple], float]:
        """The resources a pull from ``source`` into ``dest`` holds, and its bandwidth alone."""
        resources: list[tuple] = [("out", source), ("in", dest)]
        bps = self.nic_bps
        if self.rack[source] != self.rack[dest]:
            resources += [("up", self.rack[source], self.rack[dest])]
            bps = min(bps, self.uplink_bps)
        return resources, bps

    def transfer(self, source: int, dest: int, nbytes: int, now_ms: float) -> Transfer:
        resources, bps = self.path(source, dest)
        start = max([now_ms] + [self._free.get(r, 0.0) for r in resources])
        end = start + 1000.0 * nbytes / bps
        for r in resources:
            self._free[r] = end
        return Transfer(start, end, nbytes)
