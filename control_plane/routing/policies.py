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
    """Leading prompt tokens one node holds: on any tier, on its GPU, in its CPU tier."""

    node_id: str
    address: str
    any_tokens: int
    gpu_tokens: int
    cpu_tokens: int


_NOTHING = Holding("", "", 0, 0, 0)


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
                 cost: CostModel, p2p: bool, min_cached_token_delta: int) -> None:
        self.candidates = candidates
        self.prompt = prompt_tokens
        self.block_size = block_size
        self.cost = cost
        self.p2p = p2p
        self.min_delta = min_cached_token_delta

        def tokens(blocks: int) -> int:
            return min(blocks * block_size, prompt_tokens)

        self.holdings = {
            h.node_id: Holding(h.node_id, h.data_plane_address, tokens(h.leading_blocks),
                               tokens(h.per_tier.get(Medium.GPU, 0)), tokens(h.per_tier.get(Medium.CPU, 0)))
            for h in match.holders
        }
        self._waiting: dict[str, int] = {}
        for c in candidates:
            self._waiting[c.node_id] = max(self._waiting.get(c.node_id, 0), c.waiting_requests)

    def local(self, c: Candidate) -> Holding:
        """What the engine's own tiers (its co-located node) hold."""
        return self.holdings.get(c.node_id, _NOTHING)

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
        return self.cost.pull(c, self.prompt, local.any_tokens, local.gpu_tokens, h.node_id, h.cpu_tokens,
                              self.waiting_on(h.node_id))

    def threshold_source(self, c: Candidate) -> Placement:
        """llm-d's rule: the least loaded CPU holder within one block of the largest cached prefix,
        named only when it leads the engine by at least ``min_cached_token_delta`` tokens."""
        if not self.p2p:
            return Placement(c, Reason.LEAST_LOADED, SourceDecision.P2P_DISABLED, self.stay(c))
        ahead = self.ahead_of(c)
        if not ahead:
            return Placement(c, Reason.LEAST_LOADED, SourceDecision.NONE_AHEAD, self.stay(c))
        best = max(h.cpu_tokens for h in ahead)
        near = [h for h in ahead if h.cpu_tokens >= best - self.block_size]
        src = min(near, key=lambda h: (self.waiting_on(h.node_id), -h.cpu_tokens, h.node_id))
        if src.cpu_tokens - self.local(c).any_tokens < self.min_delta:
            return Placement(c, Reason.LEAST_LOADED, SourceDecision.BELOW_MIN_DELTA, self.stay(c))
        return Placement(c, Reason.LEAST_LOADED, SourceDecision.PULL, self.pull_from(c, src), src)

    def cheapest(self, c: Candidate) -> Placement:
        """Cost-aware: recompute locally or pull from the peer whose pull finishes first, whichever is sooner."""
        stay = self.stay(c)
        if not self.p2p:
            return Placement(c, Reason.LOWEST_ESTIMATED_TTFT, SourceDecision.P2P_DISABLED, stay)
        ahead = self.ahead_of(c)
        if not ahead:
            return Placement(c, Reason.LOWEST_ESTIMATED_TTFT, SourceDecision.NONE_AHEAD, stay)
        est, src = min(((self.pull_from(c, h), h) for h in ahead), key=lambda o: (o[0].ttft_ms, o[1].node_id))
        if est.ttft_ms < stay.ttft_ms:
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
    """The engine whose own tiers hold the longest prefix; the least loaded when none holds any."""

    def choose(self, ctx: RouteContext) -> Placement:
        c = min(ctx.candidates, key=lambda c: (-ctx.local(c).any_tokens, *_load(c)))
        reason = Reason.LONGEST_LOCAL_PREFIX if ctx.local(c).any_tokens else Reason.LEAST_LOADED
        return _with_reason(ctx.threshold_source(c), reason)


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
        return min(options, key=lambda p: (p.estimate.ttft_ms, *_load(p.candidate)))


POLICIES: dict[Policy, PlacementPolicy] = {
    Policy.AFFINITY: Affinity(),
    Policy.LOAD_AWARE: LoadAware(),
    Policy.TOKEN_AWARE: TokenAware(),
    Policy.COST_AWARE: CostAware(),
}
