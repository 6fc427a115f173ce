"""Placement policies: pure functions of one request's context (no I/O).

Implementor contract: ``choose`` returns one of the context's candidates and
never a KV source on the candidate's own node or one that holds no more of the
prefix than the candidate; it is deterministic (ties break on load, then on
engine id), so replicas given the same figures answer alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from control_plane.model import Medium, PrefixMatch
from control_plane.routing.cost_model import CostModel
from control_plane.routing.types import Candidate, Estimate, Policy, Reason, SourceDecision


@dataclass(frozen=True, slots=True)
class Holding:
    """Leading prompt tokens one node holds: on any tier, on its GPU, in its CPU tier, on its disk."""

    node_id: str
    address: str
    any_tokens: int
    gpu_tokens: int
    cpu_tokens: int
    disk_tokens: int = 0


_NOTHING = Holding("", "", 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Placement:
    candidate: Candidate
    reason: Reason
    source_decision: SourceDecision
    estimate: Estimate
    source: Holding | None = None


class RouteContext:
    """What the policies see: the prompt, who holds how much of it, the candidates and the cost model."""

    def __init__(self, candidates: tuple[Candidate, ...], prompt_tokens: int, block_size: int, match: PrefixMatch,
                 cost: CostModel, p2p: bool, min_cached_token_delta: int, tier_weights: tuple[float, float] = (1.0, 1.0),
                 spill_waiting: int = 0, work_weight: float = 0.0, work_waiting_cap: float = float("inf")) -> None:
        """``tier_weights``: (CPU, disk) weight of a token held only there (GPU: 1); ``spill_waiting``: affinity
        with P2P leaves a holder this many waiting requests busier than the least loaded engine (0: never);
        ``work_weight``: cost-aware charges each option its prefill time times this times the mean waiting
        requests per candidate, counted up to ``work_waiting_cap`` (GPU time spent now is queueing for the requests
        behind it; past the cap, more queue does not make it count more)."""
        self.candidates = candidates
        self.prompt = prompt_tokens
        self.block_size = block_size
        self.cost = cost
        self.p2p = p2p
        self.min_delta = min_cached_token_delta
        self.tier_weights = tier_weights
        self.spill_waiting = spill_waiting
        mean_waiting = sum(c.waiting_requests for c in candidates) / len(candidates)
        self.load_factor = work_weight * min(work_waiting_cap, mean_waiting)

        def tokens(blocks: int) -> int:
            return min(blocks * block_size, prompt_tokens)

        self.holdings = {
            h.node_id: Holding(h.node_id, h.data_plane_address, tokens(h.leading_blocks),
                               tokens(h.per_tier.get(Medium.GPU, 0)), tokens(h.per_tier.get(Medium.CPU, 0)),
                               tokens(h.per_tier.get(Medium.DISK, 0)))
            for h in match.holders
        }
        self._waiting: dict[str, int] = {}
        for c in candidates:
            self._waiting[c.node_id] = max(self._waiting.get(c.node_id, 0), c.waiting_requests)

    def local(self, c: Candidate) -> Holding:
        """What the engine's own tiers (its co-located node) hold."""
        return self.holdings.get(c.node_id, _NOTHING)

    def score(self, h: Holding) -> float:
        """Leading tokens weighted by the fastest tier holding them: GPU 1, CPU-only and disk-only less."""
        w_cpu, w_disk = self.tier_weights
        fast = max(h.gpu_tokens, h.cpu_tokens)
        return h.gpu_tokens + w_cpu * (fast - h.gpu_tokens) + w_disk * max(0, h.any_tokens - fast)

    def waiting_on(self, node_id: str) -> int:
        """Waiting requests of the engines on a node (0 when none is a candidate)."""
        return self._waiting.get(node_id, 0)

    def ahead_of(self, c: Candidate) -> list[Holding]:
        """Peers whose CPU tier holds more of the prefix than the engine's own tiers."""
        local = self.local(c).any_tokens
        return [h for h in self.holdings.values() if h.node_id != c.node_id and h.cpu_tokens > local]

    def stay(self, c: Candidate) -> Estimate:
        local = self.local(c)
        return self.cost.recompute(c, self.prompt, local.any_tokens, local.gpu_tokens)

    def pull_from(self, c: Candidate, h: Holding) -> Estimate:
        local = self.local(c)
        return self.cost.pull(c, self.prompt, local.any_tokens, local.gpu_tokens, h.node_id, h.cpu_tokens)

    def threshold_source(self, c: Candidate) -> Placement:
        """llm-d's rule: the least loaded CPU holder within one block of the largest cached prefix,
        named only when it leads the engine by at least ``min_cached_token_delta`` tokens."""
        if not self.p2p:
            return Placement(c, Reason.LEAST_LOADED, SourceDecision.P2P_DISABLED, self.stay(c))
        ahead = self.ahead_of(c)
        if not ahead:
            return Placement(c, Reason.LEAST_LOADED, SourceDecision.NONE_AHEAD, self.stay(c))
        best = max(self.score(h) for h in ahead)
        near = [h for h in ahead if self.score(h) >= best - self.block_size]
        src = min(near, key=lambda h: (self.waiting_on(h.node_id), -self.score(h), h.node_id))
        if src.cpu_tokens - self.local(c).any_tokens < self.min_delta:
            return Placement(c, Reason.LEAST_LOADED, SourceDecision.BELOW_MIN_DELTA, self.stay(c))
        return Placement(c, Reason.LEAST_LOADED, SourceDecision.PULL, self.pull_from(c, src), src)

    def charge(self, e: Estimate) -> float:
        """Cost-aware's objective: the estimated TTFT, plus the option's prefill time weighted by the fleet's
        queues (0 on an idle fleet, where only this request's TTFT counts)."""
        return e.ttft_ms + self.load_factor * e.prefill_ms

    def cheapest(self, c: Candidate) -> Placement:
        """Cost-aware: recompute locally or pull from the peer whose pull finishes first, whichever charges less."""
        stay = self.stay(c)
        if not self.p2p:
            return Placement(c, Reason.LOWEST_ESTIMATED_TTFT, SourceDecision.P2P_DISABLED, stay)
        ahead = self.ahead_of(c)
        if not ahead:
            return Placement(c, Reason.LOWEST_ESTIMATED_TTFT, SourceDecision.NONE_AHEAD, stay)
        est, src = min(((self.pull_from(c, h), h) for h in ahead), key=lambda o: (self.charge(o[0]), o[1].node_id))
        if self.charge(est) < self.charge(stay):
            return Placement(c, Reason.LOWEST_ESTIMATED_TTFT, SourceDecision.PULL, est, src)
        return Placement(c, Reason.LOWEST_ESTIMATED_TTFT, SourceDecision.RECOMPUTE_CHEAPER, stay)


def _load(c: Candidate) -> tuple[int, int, str]:
    return (c.waiting_requests, c.running_tokens, c.engine_id)


def _with_reason(p: Placement, reason: Reason) -> Placement:
    return Placement(p.candidate, reason, p.source_decision, p.estimate, p.source)


class PlacementPolicy(ABC):
    @abstractmethod
    def choose(self, ctx: RouteContext) -> Placement:
        """The engine to run on and the KV source to pull from, if any."""


class Affinity(PlacementPolicy):
    """The engine whose own tiers hold the longest prefix (tier-weighted; among holders within one block of the
    best, the least loaded); the least loaded when none holds any. With P2P, a holder ``spill_waiting`` waiting
    requests busier than the least loaded engine is left for that engine, which pulls from it (threshold rule)."""

    def choose(self, ctx: RouteContext) -> Placement:
        best = max(ctx.score(ctx.local(c)) for c in ctx.candidates)
        if best <= 0:
            return _with_reason(ctx.threshold_source(min(ctx.candidates, key=_load)), Reason.LEAST_LOADED)
        near = [c for c in ctx.candidates if ctx.score(ctx.local(c)) >= best - ctx.block_size]
        c = min(near, key=lambda c: (*_load(c), -ctx.score(ctx.local(c))))
        idle = min(ctx.candidates, key=_load)
        if ctx.p2p and ctx.spill_waiting and c.waiting_requests - idle.waiting_requests >= ctx.spill_waiting:
            spilled = ctx.threshold_source(idle)
            if spilled.source is not None:
                return _with_reason(spilled, Reason.LEAST_LOADED)
        return _with_reason(ctx.threshold_source(c), Reason.LONGEST_LOCAL_PREFIX)


class LoadAware(PlacementPolicy):
    """The engine with the fewest waiting requests, then the smallest token backlog."""

    def choose(self, ctx: RouteContext) -> Placement:
        return _with_reason(ctx.threshold_source(min(ctx.candidates, key=_load)), Reason.LEAST_LOADED)


class TokenAware(PlacementPolicy):
    """The engine with the fewest tokens to prefill before this request's first token:
    its backlog plus the prompt tokens its own tiers do not hold."""

    def choose(self, ctx: RouteContext) -> Placement:
        c = min(ctx.candidates,
                key=lambda c: (c.running_tokens + ctx.prompt - ctx.local(c).any_tokens, *_load(c)))
        return _with_reason(ctx.threshold_source(c), Reason.FEWEST_TOKENS_TO_PREFILL)


class CostAware(PlacementPolicy):
    """The engine and option (recompute or pull) with the lowest estimated time to first token."""

    def choose(self, ctx: RouteContext) -> Placement:
        options = [ctx.cheapest(c) for c in ctx.candidates]
        return min(options, key=lambda p: (ctx.charge(p.estimate), *_load(p.candidate)))


POLICIES: dict[Policy, PlacementPolicy] = {
    Policy.AFFINITY: Affinity(),
    Policy.LOAD_AWARE: LoadAware(),
    Policy.TOKEN_AWARE: TokenAware(),
    Policy.COST_AWARE: CostAware(),
}
