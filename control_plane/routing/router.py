"""The Route entry point: validate, look the prefix up in the block map, apply a policy, count.

The router is what ``ControlPlane.route`` and ``ControlPlane.report_stats``
delegate to. It owns the per-replica counters the metrics exporter reads
(:class:`RouteCounters`); the figures themselves live in the stats store.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from kvmesh.hashing import Extras
from kvmesh.namespace import Namespace

from control_plane.model import ALL_TIERS, Medium, PrefixMatch
from control_plane.routing.config import RoutingSettings
from control_plane.routing.cost_model import CostModel
from control_plane.routing.policies import POLICIES, RouteContext
from control_plane.routing.stats import StatsStore
from control_plane.routing.types import KvSource, Policy, RouteDecision, RouteRequest, StatsReport

# core.lookup_prefix: (namespace, block_hashes, token_ids, extras, tier mask) -> match
Lookup = Callable[[Namespace, list[bytes], list[int], Extras, int], Awaitable[PrefixMatch]]


@dataclass
class RouteCounters:
    """Monotonic counters of this replica (for the metrics exporter)."""

    decisions: collections.Counter = field(default_factory=collections.Counter)  # (policy label, reason name)
    source_decisions: collections.Counter = field(default_factory=collections.Counter)  # decision name
    routed_pull_tokens: int = 0   # tokens routes asked engines to pull
    pulls_reported: int = 0       # PullOutcome reports received
    stale_pulls: int = 0          # of which the source held fewer blocks than routed
    blocks_routed: int = 0
    blocks_missed: int = 0

    @property
    def stale_route_rate(self) -> float:
        return self.stale_pulls / self.pulls_reported if self.pulls_reported else 0.0


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Router:
    def __init__(self, stats: StatsStore, settings: RoutingSettings) -> None:
        self._stats = stats
        self._settings = settings
        self._default_policy = Policy.from_label(settings.route_default_policy)
        self.counters = RouteCounters()

    async def route(self, request: RouteRequest, lookup: Lookup) -> RouteDecision:
        """``lookup`` is the core's (authorized, validating) prefix lookup for the caller."""
        request.validate()
        match = await lookup(request.namespace, list(request.block_hashes), list(request.token_ids),
                                   request.extras, ALL_TIERS)
        s = self._settings
        cost = CostModel(await self._stats.figures(), s, request.kv_bytes_per_token or s.route_kv_bytes_per_token)
        ctx = RouteContext(request.candidates, request.prompt_length, request.namespace.cache_config.block_size,
                           match, cost, request.p2p, request.min_cached_token_delta or s.route_min_cached_token_delta)
        policy = request.policy or self._default_policy
        placement = POLICIES[policy].choose(ctx)
        source = None
        if placement.source is not None:
            host, port = _split_address(placement.source.address)
            source = KvSource(placement.source.node_id, host, port, Medium.CPU, placement.source.cpu_tokens,
                              request.kv_request_id)
            self.counters.routed_pull_tokens += source.cached_tokens - ctx.local(placement.candidate).any_tokens
        self.counters.decisions[(policy.label, placement.reason.name)] += 1
        self.counters.source_decisions[placement.source_decision.name] += 1
        return RouteDecision(
            engine_id=placement.candidate.engine_id, reason=placement.reason,
            source_decision=placement.source_decision, prompt_tokens=ctx.prompt,
            local_cached_tokens=ctx.local(placement.candidate).any_tokens, estimate=placement.estimate,
            source=source,
        )

    async def report(self, report: StatsReport) -> None:
        report.validate()
        await self._stats.report(report)
        for pull in report.pulls:
            self.counters.pulls_reported += 1
            self.counters.stale_pulls += pull.stale
            self.counters.blocks_routed += pull.blocks_routed
            self.counters.blocks_missed += pull.blocks_routed - pull.blocks_hit

    async def close(self) -> None:
        await self._stats.close()
