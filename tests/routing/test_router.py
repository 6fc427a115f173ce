"""The router in process (no server): speculative entries, the pull ledger, tier weights, near ties, the
affinity spill and the pull break-even, on a controllable clock."""

from __future__ import annotations

import math

import pytest

from kvmesh.namespace import CacheConfig, Namespace

from control_plane.model import Medium, NodePrefix, PrefixMatch
from control_plane.routing.config import RoutingSettings
from control_plane.routing.cost_model import Figures
from control_plane.routing.router import Router
from control_plane.routing.stats import StatsStore
from control_plane.routing.types import (
    Candidate, EngineSample, LinkSample, Policy, PullOutcome, RouteRequest, SourceDecision, StatsReport,
)

B = 32
KV = 100_000
HASHES = [bytes([i]) * 32 for i in range(64)]


class FixedStats(StatsStore):
    def __init__(self, figures: Figures = Figures()) -> None:
        self.f = figures

    async def report(self, report, reporter="") -> None:
        pass

    async def figures(self) -> Figures:
        return self.f

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router(clock: Clock, figures: Figures = Figures(), **settings) -> Router:
    s = RoutingSettings(route_prefill_tokens_per_s=10_000, route_link_bytes_per_s=10e9,
                        route_promotion_bytes_per_s=50e9, route_lookup_ms=1.0, **settings)
    return Router(FixedStats(figures), s, clock=clock)


def lookup_of(holders: list[NodePrefix]):
    async def lookup(ns, hashes, token_ids, extras, tiers):
        return PrefixMatch(len(hashes), sorted(holders, key=lambda h: -h.leading_blocks))
    return lookup


def held(node: str, gpu: int = 0, cpu: int = 0, disk: int = 0) -> NodePrefix:
    return NodePrefix(node, f"{node}.local:7100", max(gpu, cpu, disk),
                      {Medium.GPU: gpu, Medium.CPU: cpu, Medium.DISK: disk})


NS = Namespace("acme", "m", "v1", CacheConfig(block_size=B)).validate()


def request(cands, policy: Policy, *, blocks: int = 64, p2p: bool = True) -> RouteRequest:
    return RouteRequest(NS, tuple(cands), block_hashes=tuple(HASHES[:blocks]), policy=policy, p2p=p2p,
                        kv_bytes_per_token=KV)


CANDS = [Candidate("a", "a"), Candidate("b", "b"), Candidate("c", "c")]


async def test_speculative_entries_keep_back_to_back_requests_together_until_they_expire():
    clock = Clock()
    r = router(clock, route_speculative_ttl_ms=2000)
    nobody = lookup_of([])
    first = await r.route(request(CANDS, Policy.AFFINITY), nobody)
    busier = [Candidate(c.engine_id, c.node_id, waiting_requests=1 if c.engine_id == first.engine_id else 0)
              for c in CANDS]
    again = await r.route(request(busier, Policy.AFFINITY), nobody)
    assert again.engine_id == first.engine_id and again.local_cached_tokens == 64 * B
    clock.now += 2.5   # expired: the least loaded engine again
    later = await r.route(request(busier, Policy.AFFINITY), nobody)
    assert later.engine_id != first.engine_id and later.local_cached_tokens == 0


async def test_one_tenant_routing_huge_prompts_keeps_only_its_share_of_the_speculative_entries():
    """Found in review: the speculative entries are every tenant's, 200,000 at most, oldest out: one tenant's five
    routes of 60,000-block prompts pushed every other tenant's out, and their back-to-back requests scattered. One
    tenant's routes now hold at most MAX_ENTRIES_PER_OWNER (50,000), its own oldest going first. Control: the
    flooding tenant's own latest prompt is still remembered."""
    from control_plane.routing.speculative import MAX_ENTRIES_PER_OWNER
    clock = Clock()
    r = router(clock, route_speculative_ttl_ms=2000)
    nobody = lookup_of([])
    first = await r.route(request(CANDS, Policy.AFFINITY), nobody)  # tenant acme's prompt
    flooder = Namespace("flood", "m", "v1", CacheConfig(block_size=B)).validate()
    for i in range(5):
        huge = tuple(i.to_bytes(2, "big") + j.to_bytes(4, "big") + bytes(26) for j in range(60_000))
        await r.route(RouteRequest(flooder, (Candidate("c", "c"),), block_hashes=huge, policy=Policy.AFFINITY,
                                   kv_bytes_per_token=KV), nobody)
    busier = [Candidate(c.engine_id, c.node_id, waiting_requests=1 if c.engine_id == first.engine_id else 0)
              for c in CANDS]
    again = await r.route(request(busier, Policy.AFFINITY), nobody)
    assert again.engine_id == first.engine_id, "another tenant's routes pushed this tenant's entries out"
    assert r.speculative.leading_blocks((flooder, RouteRequest(flooder, (), block_hashes=huge).extras), ["c"],
                                        list(huge)) == {"c": MAX_ENTRIES_PER_OWNER}


async def test_candidates_naming_one_node_many_times_scan_its_speculative_entries_once():
    """Found in review: a scheduler's route with 1,024 candidate engines on one node scanned that node's entries
    once per engine: after a 50,000-block prompt was routed there, ~51M probes (~5 s of the control plane's loop)
    per route, repeatable. Each node is scanned once now; control: the node's routed prefix is still found."""
    clock = Clock()
    r = router(clock, route_speculative_ttl_ms=60_000)
    nobody = lookup_of([])
    prompt = tuple(j.to_bytes(4, "big") + bytes(28) for j in range(50_000))
    await r.route(RouteRequest(NS, (Candidate("c", "c"),), block_hashes=prompt, policy=Policy.AFFINITY,
                               kv_bytes_per_token=KV), nobody)
    scope = (NS, RouteRequest(NS, (), block_hashes=prompt).extras)

    class Probed(dict):
        probes = 0

        def get(self, key, default=None):
            Probed.probes += 1
            return super().get(key, default)

    r.speculative._expiry[scope] = Probed(r.speculative._expiry[scope])
    engines = tuple(Candidate(f"e{i}", "c") for i in range(1024))
    decision = await r.route(RouteRequest(NS, engines, block_hashes=prompt, policy=Policy.AFFINITY,
                                          kv_bytes_per_token=KV), nobody)
    assert decision.local_cached_tokens == 50_000 * B
    # one scan, and the purge of the older copies of the entries this route records again
    assert Probed.probes <= 2 * 50_000, f"{Probed.probes} probes for one node's 50,000 entries"


async def test_without_speculative_entries_back_to_back_requests_scatter():
    clock = Clock()
    r = router(clock, route_speculative_ttl_ms=0)
    first = await r.route(request(CANDS, Policy.AFFINITY), lookup_of([]))
    busier = [Candidate(c.engine_id, c.node_id, waiting_requests=1 if c.engine_id == first.engine_id else 0)
              for c in CANDS]
    assert (await r.route(request(busier, Policy.AFFINITY), lookup_of([]))).engine_id != first.engine_id


async def test_the_ledger_queues_a_second_pull_behind_the_first_on_the_same_nic():
    clock = Clock()
    r = router(clock, route_speculative_ttl_ms=0)
    holders = lookup_of([held("a", cpu=64)])
    cands = [Candidate("a", "a", 9, 10**6), Candidate("b", "b"), Candidate("c", "c")]
    one = await r.route(request(cands, Policy.COST_AWARE), holders)
    two = await r.route(request(cands, Policy.COST_AWARE), holders)
    assert one.source_decision is SourceDecision.PULL and two.source_decision is SourceDecision.PULL
    wire = 1000.0 * 64 * B * KV / 10e9
    assert one.estimate.transfer_ms == pytest.approx(wire)
    assert two.estimate.transfer_ms == pytest.approx(2 * wire)   # waits for the first on a's NIC
    clock.now += 1.0
    assert (await r.route(request(cands, Policy.COST_AWARE), holders)).estimate.transfer_ms == pytest.approx(wire)


async def test_a_route_with_a_made_up_backlog_books_a_source_for_everyone_at_most_briefly():
    """Found in review: the ledger is every tenant's, and booked a pull after the chosen engine's queue, a figure
    the caller gives: one Route naming a made-up candidate with a backlog of 2^62 tokens booked the source's NIC
    for ~10^14 s, and every other tenant's pull from it was RECOMPUTE_CHEAPER until a restart. Now no link is
    booked past MAX_AHEAD_S (30 s). Control: the victim pulls before, and its pull waits while the booking lasts."""
    from control_plane.routing.ledger import MAX_AHEAD_S
    clock = Clock()
    r = router(clock, route_speculative_ttl_ms=0)
    holders = lookup_of([held("a", cpu=64)])
    victim = Namespace("victim", "m", "v1", CacheConfig(block_size=B)).validate()

    def victims_route() -> RouteRequest:
        return RouteRequest(victim, (Candidate("b", "b"),), block_hashes=tuple(HASHES), policy=Policy.COST_AWARE,
                            kv_bytes_per_token=KV)

    assert (await r.route(victims_route(), holders)).source_decision is SourceDecision.PULL  # control
    clock.now += 1.0
    made_up = RouteRequest(NS, (Candidate("x", "x", 0, 2**62),), block_hashes=tuple(HASHES),
                           policy=Policy.LOAD_AWARE, kv_bytes_per_token=KV)
    assert (await r.route(made_up, holders)).source_decision is SourceDecision.PULL  # booked a's NIC
    assert 0 < r.ledger.wait_s("a", "b", booker=NS.tenant) <= MAX_AHEAD_S
    clock.now += MAX_AHEAD_S + 1.0
    assert (await r.route(victims_route(), holders)).source_decision is SourceDecision.PULL, \
        "a made-up backlog still keeps every tenant from pulling from the source"


async def test_one_tenant_routing_made_up_backlogs_at_most_doubles_another_tenants_pull():
    """Found in review (stop 36's residue): the ledger delayed every tenant's pull in full behind every route's
    booking, so a scheduler routing made-up backlogs (each booking up to MAX_AHEAD_S) kept every other tenant's
    pulls from the nodes it named RECOMPUTE_CHEAPER for as long as it went on. Now a pull waits in full for its own
    booker's pulls only, and for each other booker's at most its own wait and transfer (a shared link's fair share).
    Control: the attacker's own pulls wait behind its bookings in full."""
    clock = Clock()
    r = router(clock, route_speculative_ttl_ms=0)
    holders = lookup_of([held("a", cpu=64)])
    victim = Namespace("victim", "m", "v1", CacheConfig(block_size=B)).validate()
    wire_ms = 1000.0 * 64 * B * KV / 10e9
    for _ in range(5):
        made_up = RouteRequest(NS, (Candidate("x", "x", 0, 2**62),), block_hashes=tuple(HASHES),
                               policy=Policy.LOAD_AWARE, kv_bytes_per_token=KV)
        assert (await r.route(made_up, holders)).source_decision is SourceDecision.PULL
        clock.now += 1.0
    got = await r.route(RouteRequest(victim, (Candidate("b", "b"),), block_hashes=tuple(HASHES),
                                     policy=Policy.COST_AWARE, kv_bytes_per_token=KV), holders)
    assert got.source_decision is SourceDecision.PULL, "one tenant's made-up backlogs keep another from pulling"
    assert wire_ms < got.estimate.transfer_ms <= 2 * wire_ms + 1e-6
    assert r.ledger.wait_s("a", "b", seconds=wire_ms / 1000.0, booker=NS.tenant) > 20.0   # control: its own


async def test_a_kv_size_past_any_model_is_refused_in_one_line():
    from kvmesh.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="kv_bytes_per_token 17000000 is more than"):
        RouteRequest(NS, tuple(CANDS), block_hashes=tuple(HASHES), kv_bytes_per_token=17_000_000).validate()
    RouteRequest(NS, tuple(CANDS), block_hashes=tuple(HASHES), kv_bytes_per_token=16 << 20).validate()  # control


@pytest.mark.parametrize("bandwidth", [1e6, 3e6, 1e7, 3e7, 1e8, 3e8, 1e9, 3e9, 1e10])
async def test_cost_aware_never_pulls_below_break_even(bandwidth):
    """One idle engine, a peer holding 48 of 64 blocks: pull exactly when lookup + wire + promotion of the 1,536
    tokens is shorter than prefilling them."""
    clock = Clock()
    figures = Figures(link_bytes_per_s={("a", "b"): bandwidth})
    r = router(clock, figures, route_speculative_ttl_ms=0)
    d = await r.route(request([Candidate("b", "b")], Policy.COST_AWARE), lookup_of([held("a", cpu=48)]))
    tokens = 48 * B
    pull_ms = 1.0 + 1000.0 * tokens * KV / bandwidth + 1000.0 * tokens * KV / 50e9
    recompute_ms = 1000.0 * tokens / 10_000
    assert (d.source_decision is SourceDecision.PULL) == (pull_ms < recompute_ms)
    if d.source is not None:
        assert d.estimate.ttft_ms < recompute_ms + 1000.0 * 16 * B / 10_000


async def test_tier_weights_prefer_a_gpu_holder_to_a_longer_disk_one():
    clock = Clock()
    holders = lookup_of([held("a", gpu=40), held("b", disk=44)])
    assert (await router(clock).route(request(CANDS, Policy.AFFINITY), holders)).engine_id == "a"
    flat = router(clock, route_tier_weight_disk=1.0)   # negative control: unweighted, the longer prefix wins
    assert (await flat.route(request(CANDS, Policy.AFFINITY), holders)).engine_id == "b"


async def test_near_tied_holders_are_chosen_by_queue_depth():
    clock = Clock()
    cands = [Candidate("a", "a", 3), Candidate("b", "b", 0), Candidate("c", "c", 0)]
    near = lookup_of([held("a", gpu=40), held("b", gpu=39)])
    assert (await router(clock).route(request(cands, Policy.AFFINITY), near)).engine_id == "b"
    apart = lookup_of([held("a", gpu=40), held("b", gpu=36)])   # 4 blocks apart: the longer prefix wins
    assert (await router(clock).route(request(cands, Policy.AFFINITY), apart)).engine_id == "a"


async def test_affinity_with_p2p_spills_a_busy_holder_and_without_p2p_stays():
    clock = Clock()
    cands = [Candidate("a", "a", 5), Candidate("b", "b", 0)]
    holders = lookup_of([held("a", cpu=40)])
    spilled = await router(clock).route(request(cands, Policy.AFFINITY), holders)
    assert spilled.engine_id == "b" and spilled.source is not None and spilled.source.node_id == "a"
    stayed = await router(clock).route(request(cands, Policy.AFFINITY, p2p=False), holders)
    assert stayed.engine_id == "a" and stayed.source is None
    calm = [Candidate("a", "a", 3), Candidate("b", "b", 0)]   # below route_affinity_spill_waiting (4)
    assert (await router(clock).route(request(calm, Policy.AFFINITY), holders)).engine_id == "a"


def test_a_ledger_of_many_live_links_is_not_rebuilt_on_every_booking():
    """Found in review: past 10,000 links the ledger dropped finished bookings on every booking, a rebuild of the
    whole ledger each time; destinations are node ids a route's caller names, so made-up candidates kept 10,000+
    links live (30 s each) and made every route O(links). It is pruned again only once the live links doubled;
    control: finished links are still dropped."""
    from control_plane.routing.ledger import PRUNE_PAST_LINKS, PullLedger

    clock = Clock()
    ledger = PullLedger(clock)
    rebuilds, table = 0, ledger._free_at
    for i in range(3 * PRUNE_PAST_LINKS):
        ledger.add("src", f"made-up-{i}", seconds=20.0)
        if ledger._free_at is not table:
            rebuilds, table = rebuilds + 1, ledger._free_at
    assert rebuilds <= 3, f"{rebuilds} rebuilds for {3 * PRUNE_PAST_LINKS} bookings"
    clock.now += 60  # every booking over: the next pruning drops them
    for i in range(ledger._prune_past + 1):
        ledger.add("src", f"later-{i}", seconds=1.0)
    assert not [link for link in ledger._free_at if link[-1].startswith("made-up-")]


async def test_a_holder_the_tenants_policy_excludes_is_never_named_as_the_source():
    """Found in review (F3b): the router named any holder its lookup (or a speculative entry) gave as the pull
    source. Given the tenant policy's check (``node_allowed``, from ControlPlane.route), a holder on an excluded node
    is never the source, even when it holds the longest prefix. Control: without the check, it is the source."""
    clock = Clock()
    cands = [Candidate("b", "b"), Candidate("c", "c")]
    holders = lookup_of([held("x", cpu=60), held("a", cpu=40)])

    async def allowed(node_id: str) -> bool:
        return node_id != "x"

    d = await router(clock).route(request(cands, Policy.LOAD_AWARE), holders, node_allowed=allowed)
    assert d.source is not None and d.source.node_id == "a", d.explanation  # red before: no node_allowed at all
    control = await router(clock).route(request(cands, Policy.LOAD_AWARE), holders)
    assert control.source is not None and control.source.node_id == "x"


@pytest.mark.parametrize("report, field", [
    (StatsReport(engines=(EngineSample("a", 1e300),)), "prefill_tokens_per_s"),
    (StatsReport(engines=(EngineSample("a", 1.5e8),)), "prefill_tokens_per_s"),
    (StatsReport(engines=(EngineSample("a", math.nan),)), "prefill_tokens_per_s"),
    (StatsReport(engines=(EngineSample("a", math.inf),)), "prefill_tokens_per_s"),
    (StatsReport(links=(LinkSample("a", "b", 1e13),)), "bytes_per_s"),
    (StatsReport(links=(LinkSample("a", "b", math.nan),)), "bytes_per_s"),
    (StatsReport(pulls=(PullOutcome("a", 1 << 30, 0),)), "blocks_routed"),
])
def test_a_figure_past_anything_measured_is_refused_in_one_line(report, field):
    """Found in review (F3a): a node reported its own engine at 1e300 tokens/s (finite, so accepted) and took the
    cost-aware routes of other tenants' schedulers to that engine. Control: the largest plausible figures pass."""
    from kvmesh.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match=field) as err:
        report.validate()
    assert "\n" not in str(err.value)
    StatsReport(links=(LinkSample("a", "b", 1e12),), engines=(EngineSample("a", 1e8),),
                pulls=(PullOutcome("a", 1 << 24, 1 << 24),)).validate()
