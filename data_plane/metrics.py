"""Data-plane metrics (Prometheus), recorded by the core at each tier change.

Hit rate by tier (local acquires and peer lookups: CPU hit, disk hit, miss),
bytes written by the engine, read by peers and pulled from them, pull and
promotion times, pending waits, and evictions — with evictions of blocks that
were never read since they were stored ("evicted before reuse"), and blocks
purged because their tenant was deleted or re-created; landing-arena slots held
after a transfer that may still write, and those reclaimed once proven safe; and
how full each tier is (:class:`TierUsageCollector`, read when scraped).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from kvmesh.metrics import LATENCY_BUCKETS

from data_plane.types import BlockKey


class DataPlaneMetrics:
    """One node's metrics in ``registry``. Event-loop thread only."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._blocks = Counter("kvmesh_dp_blocks", "blocks asked for, by who asked and where they were found",
                               ["caller", "result"], registry=r)
        self._bytes = Counter("kvmesh_dp_bytes", "bytes by direction", ["direction"], registry=r)
        self._pull_seconds = Histogram("kvmesh_dp_pull_seconds", "whole pulls", registry=r, buckets=LATENCY_BUCKETS)
        self._pull_blocks = Counter("kvmesh_dp_pull_blocks", "blocks of pulls by outcome", ["outcome"], registry=r)
        self._promotion_seconds = Histogram("kvmesh_dp_promotion_seconds", "disk to CPU-tier promotions",
                                            registry=r, buckets=LATENCY_BUCKETS)
        self._pending = Histogram("kvmesh_dp_pending_wait_seconds", "waits on HIT_PENDING blocks", registry=r,
                                  buckets=LATENCY_BUCKETS)
        self._evictions = Counter("kvmesh_dp_evictions", "blocks evicted from a tier", ["tier"], registry=r)
        self._unused = Counter("kvmesh_dp_evictions_before_reuse",
                               "blocks evicted from the CPU tier without having been read since stored", registry=r)
        self._purged = Counter("kvmesh_dp_purged_blocks", "blocks dropped from a tier because their tenant was "
                               "deleted or re-created (an earlier tenant epoch)", registry=r)
        self._unverified = Counter("kvmesh_dp_unknown_epoch_blocks_dropped", "blocks committed while the node did "
                                   "not know their tenant's epoch (the control plane had not answered), dropped once "
                                   "it did (also counted in kvmesh_dp_purged_blocks)", registry=r)
        self._quarantined = Gauge("kvmesh_dp_quarantined_slots", "landing-arena slots held now (a transfer "
                                  "from their source that may still write into them failed; never CPU-tier "
                                  "slots)", registry=r)
        self._quarantines = Counter("kvmesh_dp_quarantine_slots", "landing-arena slots held after a failed "
                                    "transfer, in all", registry=r)
        self._reclaimed = Counter("kvmesh_dp_reclaimed_slots", "held landing-arena slots freed again once no "
                                  "write could land in them (or their arena was renewed, or went with the NIXL agent)",
                                  registry=r)
        self._read_since_stored: set[BlockKey] = set()
        self._children: dict[tuple, object] = {}  # (metric, labels) -> child: labels() costs ~5 us a call

    def _child(self, metric, *labels: str):
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def found(self, caller: str, result: str, n: int = 1) -> None:
        """``caller``: local | peer; ``result``: cpu | disk | miss | corrupt (its bytes changed since stored)."""
        if n:
            self._child(self._blocks, caller, result).inc(n)

    def read(self, key: BlockKey) -> None:
        self._read_since_stored.add(key)

    def read_all(self, keys: list[BlockKey]) -> None:
        self._read_since_stored.update(keys)

    def bytes(self, direction: str, n: int) -> None:
        """``direction``: written (by the engine) | served (read by peers) | pulled (from peers)."""
        if n:
            self._child(self._bytes, direction).inc(n)

    def pull(self, seconds: float, pulled: int, missed: int) -> None:
        self._pull_seconds.observe(seconds)
        self._pull_blocks.labels("pulled").inc(pulled)
        self._pull_blocks.labels("miss").inc(missed)

    def joined(self, n: int) -> None:
        """Blocks a pull got by waiting for another in-flight pull on this node (coalesced)."""
        if n:
            self._pull_blocks.labels("joined").inc(n)

    def verify_failed(self) -> None:
        """A pulled block whose checksum did not match the source's (discarded)."""
        self._pull_blocks.labels("corrupt").inc()

    def promotion(self, seconds: float) -> None:
        self._promotion_seconds.observe(seconds)

    def pending_wait(self, seconds: float) -> None:
        self._pending.observe(seconds)

    def purged(self, n: int, unknown_epoch: int = 0) -> None:
        """``n`` blocks dropped for their tenant epoch, ``unknown_epoch`` of them stored before it was known."""
        self._purged.inc(n)
        self._unverified.inc(unknown_epoch)

    def quarantined(self, n: int, now: int) -> None:
        """``n`` slots quarantined; ``now`` are."""
        self._quarantines.inc(n)
        self._quarantined.set(now)

    def reclaimed(self, n: int, now: int) -> None:
        """``n`` quarantined slots freed; ``now`` stay quarantined."""
        self._reclaimed.inc(n)
        self._quarantined.set(now)

    def evicted_from_cpu(self, keys: list[BlockKey]) -> None:
        """:meth:`evicted` of CPU-tier blocks, counted at once."""
        if not keys:
            return
        self._child(self._evictions, "cpu").inc(len(keys))
        read = self._read_since_stored
        unused = len(keys) - len(read.intersection(keys))
        if unused:
            self._unused.inc(unused)
        read.difference_update(keys)

    def evicted(self, tier: str, key: BlockKey) -> None:
        self._child(self._evictions, tier).inc()
        if tier == "cpu":
            if key not in self._read_since_stored:
                self._unused.inc()
            self._read_since_stored.discard(key)


class TierUsageCollector:
    """``kvmesh_dp_tier_used_bytes`` and ``kvmesh_dp_tier_capacity_bytes`` by node and tier, from ``usage()``
    (``{tier: (used, capacity)}``, e.g. :meth:`data_plane.core.DataPlaneCore.usage`) at each scrape."""

    def __init__(self, node_id: str, usage: Callable[[], dict[str, tuple[int, int]]]) -> None:
        self._node = node_id
        self._usage = usage

    def collect(self):
        used = GaugeMetricFamily("kvmesh_dp_tier_used_bytes", "bytes of a tier's slots in use (reserved, written, "
                                 "or stored)", labels=["node", "tier"])
        capacity = GaugeMetricFamily("kvmesh_dp_tier_capacity_bytes", "bytes a tier holds in all",
                                     labels=["node", "tier"])
        for tier, (n_used, n_capacity) in self._usage().items():
            used.add_metric([self._node, tier], n_used)
            capacity.add_metric([self._node, tier], n_capacity)
        yield used
        yield capacity
