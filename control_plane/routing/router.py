"""The Route entry point: validate, look the prefix up in the block map, apply a policy, count.

The router is what ``ControlPlane.route`` and ``ControlPlane.report_stats``
delegate to. It owns the per-replica counters the metrics exporter reads
(:class:`RouteCounters`); the figures themselves live in the stats store.
"""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Hashable

from kvmesh.hashing import Extras
from kvmesh.namespace import Namespace

from control_plane.model import ALL_TIERS, Medium, NodePrefix, PrefixMatch
from control_plane.routing.config import RoutingSettings
from control_plane.routing.cost_model import CostModel
from control_plane.routing.ledger import PullLedger
from control_plane.routing.policies import POLICIES, RouteContext
from control_plane.routing.speculative import SpeculativeIndex
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


def _with_speculative(match: PrefixMatch, speculative: dict[str, int]) -> PrefixMatch:
    """The block map's holders, each routed node raised to (at least) its speculative GPU prefix."""
    holders = {h.node_id: h for h in match.holders}
    for node, blocks in speculative.items():
        h = holders.get(node)
        if h is None:
            holders[node] = NodePrefix(node, "", blocks, {Medium.GPU: blocks})
        elif blocks > h.per_tier.get(Medium.GPU, 0):
            holders[node] = NodePrefix(node, h.data_plane_address, max(h.leading_blocks, blocks),
                                       {**h.per_tier, Medium.GPU: blocks})
    ordered = sorted(holders.values(), key=lambda h: (-h.leading_blocks, h.node_id))
    return PrefixMatch(match.blocks_queried, ordered, match.block_hashes)


class Router:
    def __init__(self, stats: StatsStore, settings: RoutingSettings,
                 clock: Callable[[], float] = time.monotonic, zone_of: Callable[[str], str] | None = None) -> None:
        """``clock`` (seconds) times speculative entries and the pull ledger (a simulation passes its own);
        ``zone_of``: a node's zone (rack), whose uplink the ledger counts pulls between zones on (None: NICs only)."""
        self._stats = stats
        self._settings = settings
        self._default_policy = Policy.from_label(settings.route_default_policy)
        self.counters = RouteCounters()
        self.speculative = SpeculativeIndex(settings.route_speculative_ttl_ms / 1000.0, clock)
        self.ledger = PullLedger(clock, zone_of)

    async def route(self, request: RouteRequest, lookup: Lookup, may_read: bool = True,
                    records: bool = True, booker: Hashable = None,
                    node_allowed: Callable[[str], Awaitable[bool]] | None = None) -> RouteDecision:
        """``lookup`` is the core's (authorized, validating) prefix lookup for the caller; ``may_read``: may the
        caller learn what is cached in the namespace? If not, routes it has not seen (speculative state, built
        from other callers' decisions) neither inform nor record this one. ``records``: False, this route is
        not recorded as a speculative holding (a caller who is not the tenant's scheduler). ``booker``: whose
        pulls the ledger counts this route's among (see ledger; None: the namespace's tenant's). ``node_allowed``:
        does the namespace's tenant policy allow a node (None: every node)? The caller drops the candidates it
        excludes; a holder it excludes (one speculative entry, a lookup's holder) is never named as the source."""
        request.validate()
        match = await lookup(request.namespace, list(request.block_hashes), list(request.token_ids),
                                   request.extras, ALL_TIERS)
        s = self._settings
        hashes = list(request.block_hashes or match.block_hashes)
        scope = (request.namespace, request.extras)
        if may_read:
            match = _with_speculative(
                match, self.speculative.leading_blocks(scope, [c.node_id for c in request.candidates], hashes))
        if node_allowed is not None:
            match = PrefixMatch(match.blocks_queried, [h for h in match.holders if await node_allowed(h.node_id)],
                                match.block_hashes)
        booker = request.namespace.tenant if booker is None else booker
        cost = CostModel(await self._stats.figures(), s, request.kv_bytes_per_token or s.route_kv_bytes_per_token,
                         functools.partial(self.ledger.wait_s, booker=booker))
        ctx = RouteContext(request.candidates, request.prompt_length, request.namespace.cache_config.block_size,
                           match, cost, request.p2p, request.min_cached_token_delta or s.route_min_cached_token_delta,
                           (s.route_tier_weight_cpu, s.route_tier_weight_disk), s.route_affinity_spill_waiting,
                           s.route_work_weight, s.route_work_waiting_cap)
        policy = request.policy or self._default_policy
        placement = POLICIES[policy].choose(ctx)
        chosen = placement.candidate
        if may_read and records:
            self.speculative.record(scope, chosen.node_id, hashes, owner=request.namespace.tenant)
        source = None
        if placement.source is not None:
            host, port = _split_address(placement.source.address)
            source = KvSource(placement.source.node_id, host, port, Medium.CPU, placement.source.cpu_tokens,
                              request.kv_request_id)
            pulled = source.cached_tokens - ctx.local(chosen).any_tokens
            self.counters.routed_pull_tokens += pulled
            self.ledger.add(source.node_id, chosen.node_id,
                            cost.wire_ms(source.node_id, chosen.node_id, pulled) / 1000.0,
                            placement.estimate.queue_ms / 1000.0, booker)
        self.counters.decisions[(policy.label, placement.reason.name)] += 1
        self.counters.source_decisions[placement.source_decision.name] += 1
        return RouteDecision(
            engine_id=chosen.engine_id, reason=placement.reason,
            source_decision=placement.source_decision, prompt_tokens=ctx.prompt,
            local_cached_tokens=ctx.local(chosen).any_tokens, estimate=placement.estimate,
            source=source,
        )

    async def report(self, report: StatsReport, reporter: str = "") -> None:
        """``reporter``: the node whose share of the figures the report's engines count against (see StatsStore)."""
        report.validate()
        await self._stats.report(report, reporter)
        for pull in report.pulls:
            self.counters.pulls_reported += 1
            self.counters.stale_pulls += pull.stale
            self.counters.blocks_routed += pull.blocks_routed
            self.counters.blocks_missed += pull.blocks_routed - pull.blocks_hit

    async def close(self) -> None:
        await self._stats.close()
