"""The placement policies and the cost model, as plain functions (no server)."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument

from control_plane.model import Medium, NodePrefix, PrefixMatch
from control_plane.routing.config import RoutingSettings
from control_plane.routing.cost_model import CostModel, Figures
from control_plane.routing.policies import POLICIES, RouteContext
from control_plane.routing.types import Candidate, Policy, Reason, RouteRequest, SourceDecision

B = 32
KV = 100_000  # bytes per token


def holder(node: str, gpu: int = 0, cpu: int = 0, disk: int = 0) -> NodePrefix:
    return NodePrefix(node, f"{node}.local:7100", max(gpu, cpu, disk),
                      {Medium.GPU: gpu, Medium.CPU: cpu, Medium.DISK: disk})


def ctx(candidates, holders, *, prompt=64 * B, p2p=True, delta=8 * B, figures=Figures(),
        pull_wait=lambda source, dest, after_s, seconds: 0.0, spill=4, **settings) -> RouteContext:
    s = RoutingSettings(route_prefill_tokens_per_s=10_000, route_link_bytes_per_s=10e9,
                        route_promotion_bytes_per_s=50e9, route_lookup_ms=1.0, **settings)
    match = PrefixMatch(prompt // B, sorted(holders, key=lambda h: -h.leading_blocks))
    return RouteContext(tuple(candidates), prompt, B, match, CostModel(figures, s, KV, pull_wait), p2p, delta,
                        (s.route_tier_weight_cpu, s.route_tier_weight_disk), spill)


def choose(policy: Policy, c: RouteContext):
    return POLICIES[policy].choose(c)


A, Bn, C = Candidate("a", "a"), Candidate("b", "b"), Candidate("c", "c")


def test_affinity_follows_the_longest_local_prefix_even_when_loaded():
    busy_a = Candidate("a", "a", waiting_requests=9, running_tokens=90_000)
    p = choose(Policy.AFFINITY, ctx([busy_a, Bn], [holder("a", gpu=40), holder("b", cpu=10)]))
    assert p.candidate.engine_id == "a" and p.reason is Reason.LONGEST_LOCAL_PREFIX
    assert p.source_decision is SourceDecision.NONE_AHEAD and p.source is None


def test_load_aware_spreads_and_pulls_past_the_min_delta():
    busy_a = Candidate("a", "a", waiting_requests=3)
    p = choose(Policy.LOAD_AWARE, ctx([busy_a, Bn], [holder("a", cpu=40)]))
    assert p.candidate.engine_id == "b" and p.reason is Reason.LEAST_LOADED
    assert p.source_decision is SourceDecision.PULL and p.source.node_id == "a" and p.source.cpu_tokens == 40 * B


def test_min_cached_token_delta_withholds_a_small_lead():
    p = choose(Policy.LOAD_AWARE, ctx([Candidate("a", "a", 3), Bn], [holder("a", cpu=12), holder("b", cpu=8)],
                                      delta=8 * B))
    assert p.candidate.engine_id == "b" and p.source_decision is SourceDecision.BELOW_MIN_DELTA


def test_gpu_only_holders_are_not_sources():
    p = choose(Policy.LOAD_AWARE, ctx([Candidate("a", "a", 3), Bn], [holder("a", gpu=40)]))
    assert p.source_decision is SourceDecision.NONE_AHEAD


def test_threshold_source_prefers_the_less_loaded_of_near_equal_holders():
    cands = [Candidate("x", "x"), Candidate("a", "a", 5), Candidate("c", "c", 0, 10**9)]
    p = choose(Policy.LOAD_AWARE, ctx(cands, [holder("a", cpu=40), holder("c", cpu=39)]))
    assert p.candidate.engine_id == "x" and p.source.node_id == "c"


def test_token_aware_prefers_the_owner_until_its_backlog_exceeds_the_saving():
    owner = lambda backlog: Candidate("a", "a", 1, backlog)  # noqa: E731
    holders = [holder("a", gpu=48)]  # 1536 of 2048 tokens cached on a
    assert choose(Policy.TOKEN_AWARE, ctx([owner(1000), Bn], holders)).candidate.engine_id == "a"
    p = choose(Policy.TOKEN_AWARE, ctx([owner(5000), Bn], [holder("a", gpu=48, cpu=48)]))
    assert p.candidate.engine_id == "b" and p.reason is Reason.FEWEST_TOKENS_TO_PREFILL
    assert p.source_decision is SourceDecision.PULL and p.source.node_id == "a"


def test_cost_aware_pulls_over_a_fast_link_and_recomputes_over_a_slow_one():
    cands = [Candidate("a", "a", 4, 50_000), Bn]
    holders = [holder("a", cpu=60)]
    fast = choose(Policy.COST_AWARE, ctx(cands, holders))
    assert fast.candidate.engine_id == "b" and fast.source_decision is SourceDecision.PULL
    # 1920 tokens * 100 kB over 10 MB/s is ~19 s: prefilling 2048 tokens (~0.2 s) is cheaper
    slow = choose(Policy.COST_AWARE, ctx(cands, holders, figures=Figures(link_bytes_per_s={("a", "b"): 10e6})))
    assert slow.candidate.engine_id == "b" and slow.source_decision is SourceDecision.RECOMPUTE_CHEAPER
    assert slow.source is None and slow.estimate.prefill_ms == pytest.approx(204.8)


def test_cost_aware_estimate_names_every_term():
    p = choose(Policy.COST_AWARE, ctx([Bn], [holder("a", cpu=32)], prompt=64 * B))
    e = p.estimate
    tokens = 32 * B
    assert e.lookup_ms == 1.0
    assert e.transfer_ms == pytest.approx(1000 * tokens * KV / 10e9)
    assert e.promotion_ms == pytest.approx(1000 * tokens * KV / 50e9)
    assert e.prefill_ms == pytest.approx(1000 * (64 * B - tokens) / 10_000)
    assert e.ttft_ms == pytest.approx(e.lookup_ms + e.transfer_ms + e.promotion_ms + e.prefill_ms)


def test_cost_aware_sources_away_from_nics_busy_with_routed_pulls():
    cands = [Bn, Candidate("a", "a", 20, 200_000), Candidate("c", "c", 0, 10**9)]
    holders = [holder("a", cpu=60), holder("c", cpu=58)]
    assert choose(Policy.COST_AWARE, ctx(cands, holders)).source.node_id == "a"
    busy = {"a": 0.5}  # a's NIC is busy with pulls routed earlier for another 500 ms
    p = choose(Policy.COST_AWARE, ctx(cands, holders, pull_wait=lambda s, d, after, seconds: busy.get(s, 0.0)))
    assert p.candidate.engine_id == "b" and p.source.node_id == "c"


def test_p2p_disabled_never_names_a_source():
    for policy in Policy:
        p = choose(policy, ctx([Bn], [holder("a", cpu=60)], p2p=False))
        assert p.source is None and p.source_decision is SourceDecision.P2P_DISABLED


def test_measured_figures_override_defaults():
    s = RoutingSettings()
    cost = CostModel(Figures({("a", "b"): 1e9}, {"e": 2000.0}), s, 1000)
    assert cost.prefill_tokens_per_s("e") == 2000.0
    assert cost.prefill_tokens_per_s("other") == s.route_prefill_tokens_per_s
    assert cost.link_bytes_per_s("a", "b") == 1e9 and cost.link_bytes_per_s("b", "a") == s.route_link_bytes_per_s


@pytest.mark.parametrize("candidates, message", [
    ((), "at least one candidate"),
    ((A, Candidate("a", "z")), "duplicate engine_id 'a'"),
    ((Candidate("a", "a", -1),), "must be >= 0"),
    ((Candidate("a", "bad node"),), "candidates[0]"),
])
def test_route_request_validation(ns, candidates, message):
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        RouteRequest(ns, candidates, token_ids=(1, 2, 3)).validate()


def test_prompt_must_be_given_once(ns):
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        RouteRequest(ns, (A,)).validate()
    with pytest.raises(InvalidArgument, match="not both"):
        RouteRequest(ns, (A,), block_hashes=(b"x" * 32,), token_ids=(1,)).validate()
    with pytest.raises(InvalidArgument, match="shorter than"):
        RouteRequest(ns, (A,), block_hashes=(b"x" * 32,) * 2, prompt_tokens=40).validate()
