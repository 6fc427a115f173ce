"""Control-plane metrics: a BlockMap wrapper for lookups and ingest, and the router's counters.

Metrics live in a wrapper around the block map (no backend carries metrics
code) and in a collector over :class:`RouteCounters`; control_plane.server
composes them with the RPC interceptor.
"""

from __future__ import annotations

import bisect
import time

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvmesh.metrics import LATENCY_BUCKETS
from kvmesh.namespace import Namespace

from control_plane.block_map import BlockMap
from control_plane.model import Ack, Cleared, EventBatch, Medium, PrefixMatch, Stored
from control_plane.replica import BlockMapReplica
from control_plane.routing.router import RouteCounters


class MeteredBlockMap(BlockMap):
    """Forwards every call to ``inner`` and records lookups (blocks asked, matched, by tier) and ingest."""

    def __init__(self, inner: BlockMap, registry: CollectorRegistry) -> None:
        self._inner = inner
        # Plain numbers, exported at scrape time: a prometheus_client Counter or Histogram takes a lock per update
        # (six a lookup). One event loop updates them, so no lock is needed.
        self.lookup_seconds = _PlainHistogram(LATENCY_BUCKETS)
        self.lookup_blocks = dict.fromkeys(["queried", "matched", *(f"matched_{m.name.lower()}" for m in Medium)], 0)
        registry.register(_LookupCollector(self.lookup_seconds, self.lookup_blocks))
        self._batches = Counter("kvmesh_cp_event_batches", "event batches by outcome", ["status"], registry=registry)
        self._event_blocks = Counter("kvmesh_cp_event_blocks", "blocks in applied events", ["op"], registry=registry)
        self._tier_results = [(medium, f"matched_{medium.name.lower()}") for medium in Medium]

    async def lookup_prefix(self, ns: Namespace, block_hashes: list[bytes], tiers: int) -> PrefixMatch:
        start = time.perf_counter()
        match = await self._inner.lookup_prefix(ns, block_hashes, tiers)
        self.lookup_seconds.observe(time.perf_counter() - start)
        counts = self.lookup_blocks
        counts["queried"] += len(block_hashes)
        if match.holders:
            counts["matched"] += match.longest
            per_tier = [h.per_tier for h in match.holders]
            for medium, result in self._tier_results:
                counts[result] += max([t.get(medium, 0) for t in per_tier])
        return match

    async def apply_batch(self, batch: EventBatch) -> Ack:
        ack = await self._inner.apply_batch(batch)
        self._batches.labels(ack.status.name.lower()).inc()
        for event in batch.events:
            if not isinstance(event, Cleared):
                self._event_blocks.labels("stored" if isinstance(event, Stored) else "removed").inc(
                    len(event.block_hashes))
        return ack

    async def skip_batch(self, batch: EventBatch) -> Ack:
        self._batches.labels("refused").inc()
        return await self._inner.skip_batch(batch)

    async def register_node(self, node):
        return await self._inner.register_node(node)

    async def heartbeat(self, node_id, incarnation):
        return await self._inner.heartbeat(node_id, incarnation)

    async def deregister_node(self, node_id, incarnation):
        return await self._inner.deregister_node(node_id, incarnation)

    async def list_nodes(self):
        return await self._inner.list_nodes()

    async def claim_namespace(self, node_id, ns, limit):
        return await self._inner.claim_namespace(node_id, ns, limit)

    async def node_entries(self, node_id, tenant=None):
        return await self._inner.node_entries(node_id, tenant)

    async def count_new(self, ns, block_hashes):
        return await self._inner.count_new(ns, block_hashes)

    async def collect_garbage(self):
        return await self._inner.collect_garbage()

    async def close(self):
        await self._inner.close()

    def __getattr__(self, name):  # backend-specific helpers (e.g. for tests) pass through
        return getattr(self._inner, name)


class RouteCollector:
    """Exports the router's per-replica counters, including stale routes."""

    def __init__(self, counters: RouteCounters) -> None:
        self._c = counters

    def collect(self):
        decisions = CounterMetricFamily("kvmesh_cp_route_decisions", "Route decisions", labels=["policy", "reason"])
        for (policy, reason), n in self._c.decisions.items():
            decisions.add_metric([policy, reason], n)
        yield decisions
        sources = CounterMetricFamily("kvmesh_cp_route_sources", "Route source decisions", labels=["decision"])
        for decision, n in self._c.source_decisions.items():
            sources.add_metric([decision], n)
        yield sources
        yield CounterMetricFamily("kvmesh_cp_route_pull_tokens", "tokens routes asked engines to pull",
                                  value=self._c.routed_pull_tokens)
        yield CounterMetricFamily("kvmesh_cp_pulls_reported", "pull outcomes reported", value=self._c.pulls_reported)
        yield CounterMetricFamily("kvmesh_cp_stale_routes",
                                  "reported pulls whose named source no longer held what was routed",
                                  value=self._c.stale_pulls)
        yield CounterMetricFamily("kvmesh_cp_routed_blocks_missed", "routed blocks the source did not have",
                                  value=self._c.blocks_missed)
        yield GaugeMetricFamily("kvmesh_cp_stale_route_rate", "stale routes / pulls reported",
                                value=self._c.stale_route_rate)


class _PlainHistogram:
    """A histogram's bucket counts and sum as plain numbers (one event loop updates it)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _LookupCollector:
    """``kvmesh_cp_lookup_seconds`` and ``kvmesh_cp_lookup_blocks_total``, from MeteredBlockMap's plain numbers."""

    def __init__(self, seconds: _PlainHistogram, counts: dict[str, int]) -> None:
        self._seconds = seconds
        self._counts = counts

    def collect(self):
        h = self._seconds
        counts, total = list(h.counts), h.sum
        cumulative, buckets = 0, []
        for bound, n in zip([*map(float, h.bounds), float("inf")], counts):
            cumulative += n
            buckets.append((_le(bound), cumulative))
        yield HistogramMetricFamily("kvmesh_cp_lookup_seconds", "LookupPrefix time in the block map",
                                    buckets=buckets, sum_value=total)
        family = CounterMetricFamily("kvmesh_cp_lookup_blocks",
                                     "blocks asked about, and leading blocks the best holder had, by tier",
                                     labels=["result"])
        for result, n in list(self._counts.items()):
            family.add_metric([result], n)
        yield family


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client writes it (0.5, 1.0, +Inf)."""
    return "+Inf" if bound == float("inf") else repr(bound)


class ReplicaCollector:
    """Exports the in-memory replica's size, lag and resyncs (control_plane/replica.py)."""

    def __init__(self, replica: BlockMapReplica) -> None:
        self._replica = replica

    def collect(self):
        r = self._replica
        yield GaugeMetricFamily("kvmesh_cp_replica_blocks", "blocks held by the in-memory replica",
                                value=r.block_count())
        yield GaugeMetricFamily("kvmesh_cp_replica_bytes", "memory of the replica's tables and interned values",
                                value=r.memory_bytes())
        lag = sorted(r.lag_ms)
        p99 = lag[min(len(lag) - 1, int(0.99 * len(lag)))] / 1000 if lag else 0.0
        yield GaugeMetricFamily("kvmesh_cp_replica_lag_p99_seconds",
                                "p99 of the replica's lag behind Redis over its last 10,000 changes applied",
                                value=p99)
        yield CounterMetricFamily("kvmesh_cp_replica_resyncs", "replica reloads after a gap in a change stream, "
                                  "a counter gone back or a Redis failure", value=r.resyncs)
