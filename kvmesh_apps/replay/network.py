"""Pulls on a shared network: flows that share every link on their path fairly (max-min).

A pull from ``source`` into ``dest`` crosses the source's NIC out, the
destination's NIC in and, across racks, the shared uplink from the source's
rack to the destination's; each has its bandwidth, each direction apart. All
flows in progress get max-min fair rates (progressive filling), recomputed
whenever a flow starts, ends or is cancelled, so a pull slows down while others
share its bottleneck and speeds up when they end. What a puller measures is its
bytes over its whole duration, sharing included: the figure a real data plane
reports.

The simulation drives it: :meth:`start`, :meth:`cancel`, :meth:`next_end_ms`
(when the next flow ends at the current rates) and :meth:`finish` (the flows
that ended by then).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_DONE_BYTES = 1.0   # a flow with less than this left has ended (float rounding)


@dataclass(frozen=True, slots=True)
class Transfer:
    start_ms: float
    end_ms: float
    nbytes: int

    @property
    def measured_bytes_per_s(self) -> float:
        return self.nbytes / max(1e-9, (self.end_ms - self.start_ms) / 1000.0)


@dataclass(slots=True)
class _Flow:
    resources: tuple[tuple, ...]
    nbytes: int
    start_ms: float
    left: float
    rate: float = 0.0   # bytes per second


class Network:
    def __init__(self, engines: int, racks: int, nic_bytes_per_s: float, uplink_bytes_per_s: float) -> None:
        self.rack = [i * racks // engines for i in range(engines)]
        self.nic_bps = nic_bytes_per_s
        self.uplink_bps = uplink_bytes_per_s
        self._flows: dict[int, _Flow] = {}
        self._now_ms = 0.0

    def path(self, source: int, dest: int) -> tuple[list[tuple], float]:
        """The links a pull from ``source`` into ``dest`` crosses, and its bandwidth alone on them."""
        resources: list[tuple] = [("out", source), ("in", dest)]
        bps = self.nic_bps
        if self.rack[source] != self.rack[dest]:
            resources += [("up", self.rack[source], self.rack[dest])]
            bps = min(bps, self.uplink_bps)
        return resources, bps

    def _capacity(self, resource: tuple) -> float:
        return self.uplink_bps if resource[0] == "up" else self.nic_bps

    def _advance(self, now_ms: float) -> None:
        dt = max(0.0, now_ms - self._now_ms) / 1000.0
        for f in self._flows.values():
            f.left -= f.rate * dt
        self._now_ms = max(self._now_ms, now_ms)

    def _share(self) -> None:
        """Max-min fair rates: fill every unfrozen flow equally until a link saturates, freeze its flows, repeat."""
        left = {r: self._capacity(r) for f in self._flows.values() for r in f.resources}
        active = set(self._flows)
        while active:
            users: dict[tuple, list[int]] = {}
            for i in active:
                for r in self._flows[i].resources:
                    users.setdefault(r, []).append(i)
            bottleneck = min(users, key=lambda r: left[r] / len(users[r]))
            rate = left[bottleneck] / len(users[bottleneck])
            for i in users[bottleneck]:
                self._flows[i].rate = rate
                for r in self._flows[i].resources:
                    left[r] -= rate
                active.discard(i)

    def start(self, flow_id: int, source: int, dest: int, nbytes: int, now_ms: float) -> None:
        self._advance(now_ms)
        resources, _ = self.path(source, dest)
        self._flows[flow_id] = _Flow(tuple(resources), nbytes, now_ms, float(nbytes))
        self._share()

    def cancel(self, flow_id: int, now_ms: float) -> bool:
        """Stops a flow (a pull that timed out); False when it had already ended."""
        self._advance(now_ms)
        if self._flows.pop(flow_id, None) is None:
            return False
        self._share()
        return True

    def active(self, flow_id: int) -> bool:
        return flow_id in self._flows

    def next_end_ms(self) -> float:
        ends = [self._now_ms + 1000.0 * max(0.0, f.left) / f.rate for f in self._flows.values() if f.rate > 0]
        return min(ends, default=math.inf)

    def finish(self, now_ms: float) -> list[tuple[int, Transfer]]:
        """The flows that ended by ``now_ms`` (each with its transfer), removed; the others share again."""
        self._advance(now_ms)
        done = [i for i, f in self._flows.items() if f.left <= _DONE_BYTES]
        out = []
        for i in done:
            f = self._flows.pop(i)
            out.append((i, Transfer(f.start_ms, now_ms, f.nbytes)))
        if done:
            self._share()
        return out

    def transfer_alone(self, source: int, dest: int, nbytes: int) -> Transfer:
        """A transfer on an otherwise idle network (the calibration before a replay starts)."""
        _, bps = self.path(source, dest)
        return Transfer(0.0, 1000.0 * nbytes / bps, nbytes)
