"""The simulator's physics where it used to lean towards pulls (issue 20): each test fails on the old simulator."""

from __future__ import annotations

import dataclasses
import math

import pytest

from control_plane.model import Medium
from control_plane.routing.config import RoutingSettings
from control_plane.routing.ledger import PullLedger
from control_plane.routing.types import KvSource
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.replay.backends import InProcessBackend
from kvmesh_apps.replay.engine import Seq
from kvmesh_apps.replay.network import Network
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.runs import NEVER, baseline_settings, paired, run_one, summarize, verdict
from kvmesh_apps.replay.sim import Simulation, variants
from kvmesh_apps.replay.sweep import VARIANTS
from kvmesh_apps.replay.trace import BlockHashes, TraceRequest
from tests.replay.test_replay import needs_trace, spec

GB = 1e9


def test_flows_share_every_link_fairly_and_measure_the_sharing():
    net = Network(engines=4, racks=2, nic_bytes_per_s=10 * GB, uplink_bytes_per_s=1 * GB)   # racks {0, 1}, {2, 3}
    net.start(1, 0, 2, 10**9, now_ms=0.0)      # rack 0 -> rack 1: the uplink is the bottleneck
    net.start(2, 1, 3, 10**9, now_ms=0.0)      # other NICs, the same uplink: each gets half, at once
    net.start(3, 1, 0, 10**9, now_ms=0.0)      # inside rack 0: shares node 1's NIC out with flow 2
    assert net.next_end_ms() == pytest.approx(1000.0 * 10**9 / (9.5 * GB))   # flow 3: 10 GB/s less flow 2's 0.5
    first = net.finish(net.next_end_ms())
    assert [i for i, _ in first] == [3]
    assert net.next_end_ms() == pytest.approx(2000.0)   # flows 1 and 2 halve the uplink together
    done = net.finish(2000.0)
    assert sorted(i for i, _ in done) == [1, 2]
    assert all(x.measured_bytes_per_s == pytest.approx(0.5 * GB) for _, x in done)   # the sharing is measured
    net.start(4, 0, 2, 10**9, now_ms=2000.0)
    net.start(5, 1, 3, 10**9, now_ms=2500.0)   # joins half-way: flow 4 had 0.5 GB left, then shares
    assert net.cancel(5, now_ms=2600.0) and not net.cancel(5, now_ms=2600.0)
    (i, x), = net.finish(net.next_end_ms())
    assert i == 4 and x.end_ms == pytest.approx(2000.0 + 500.0 + 100.0 + (0.5e9 - 0.05e9) / 1e6)


def test_the_ledger_counts_the_uplink_between_zones():
    now = [0.0]
    zones = {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}
    ledger = PullLedger(lambda: now[0], zone_of=zones.__getitem__)
    ledger.add("a1", "b1", 2.0)
    assert ledger.wait_s("a2", "b2") == pytest.approx(2.0)   # other NICs, the same A -> B uplink
    assert ledger.wait_s("b2", "a2") == 0.0                 # the other direction's uplink is free
    assert ledger.wait_s("a2", "a1") == 0.0                 # inside zone A: no uplink, other NICs... 
    assert PullLedger(lambda: now[0]).wait_s("a2", "b2") == 0.0   # without zones: NICs only


def _sim(variant="load-aware+p2p", engines=4, requests=None, **profile) -> Simulation:
    p = dataclasses.replace(Profile(), **profile)
    v = next(x for x in variants() if x.name == variant)
    ns = Namespace("t", "m", "v", CacheConfig(block_size=p.block_tokens)).validate()
    requests = requests or [TraceRequest(0.0, 600, 1, (0,))]
    sim = Simulation(v, requests, BlockHashes(), p, engines, InProcessBackend(ns, RoutingSettings()), 0.0)
    sim.totals.last_arrival_ms = 1e9
    return sim


def _hashes(n: int, salt: int = 0) -> list[bytes]:
    return BlockHashes().of(TraceRequest(0, n * 512, 1, tuple(range(salt, salt + n))))


def test_probes_are_transfers_on_the_simulated_network():
    sim = _sim(engines=4, inter_rack_bytes_per_s=1 * GB)
    sim._pairs = [(0, 2)]                    # the next probe: rack 0 -> rack 1
    sim._start_flow(("probe", 1, 3), 1, 3, 10**10, 0.0)   # a long transfer already on the same uplink
    sim._probe(0.0)
    sim._advance(5000.0)
    probe = [x for x in sim._links if (x.source_node_id, x.dest_node_id) == (sim.engines[0].node_id,
                                                                              sim.engines[2].node_id)]
    assert len(probe) == 1 and probe[0].bytes_per_s == pytest.approx(0.5 * GB)   # half the uplink, not 1 GB/s


def test_the_router_sees_queues_as_a_lagged_snapshot_plus_what_it_routed():
    sim = _sim(engines=2)
    e = sim.engines[0]
    e.waiting.append(Seq(0.0, 1000, 1, [], None, 1000))   # work the last snapshot did not see
    assert sim._candidates()[0].waiting_requests == 0
    sim._snapshot(0.0)
    assert sim._candidates()[0].waiting_requests == 1 and sim._candidates()[0].running_tokens == 1000


def test_a_load_never_overcommits_gpu_memory():
    sim = _sim(engines=2, gpu_kv_blocks=4)
    e = sim.engines[0]
    s = Seq(0.0, 8 * 512, 1, _hashes(8), None, 1)
    s.loaded_blocks = 8
    e.loading.add(s)
    sim._loaded(e, s, 0.0)
    assert e.free_blocks() >= 0 and len(e.gpu) <= 4
    assert e.gpu.leading(s.hashes) == len(e.gpu)   # what fit is the leading blocks; the rest is recomputed


def test_offload_to_the_cpu_tier_takes_time():
    sim = _sim(engines=2, promotion_bytes_per_s=1 * GB)
    e = sim.engines[0]
    hashes = _hashes(4)
    sim._offload(e, hashes, 0.0)
    assert not any(h in e.cpu for h in hashes)
    sim._advance(1.0)
    assert not any(h in e.cpu for h in hashes)
    sim._advance(1000.0 * 4 * sim.p.block_bytes / 1e9)
    assert all(h in e.cpu for h in hashes)


def test_a_pull_fetches_no_more_than_was_routed():
    sim = _sim(engines=2)
    src, dst = sim.engines
    hashes = _hashes(10)
    src.cpu.insert(hashes)
    s = Seq(0.0, 10 * 512, 1, hashes, KvSource(src.node_id, "h", 1, Medium.CPU, 4 * 512), 6 * 512)
    dst.waiting.append(s)
    assert sim._examine(dst, s, 0.0)
    sim._advance(math.inf)
    assert s.loaded_blocks == 4 and sim.totals.bytes_moved == 4 * sim.p.block_bytes


def test_a_pull_that_outlasts_the_timeout_is_recomputed():
    sim = _sim(engines=2, nic_bytes_per_s=0.02 * GB, pull_timeout_ms=500.0)   # 10 blocks of 70B KV: ~84 s
    src, dst = sim.engines
    hashes = _hashes(10)
    src.cpu.insert(hashes)
    s = Seq(0.0, 10 * 512 + 7, 1, hashes, KvSource(src.node_id, "h", 1, Medium.CPU, 10 * 512), 7)
    dst.waiting.append(s)
    sim._kick(dst, 0.0)
    sim._advance(math.inf)
    assert sim.totals.pull_timeouts == 1 and sim.totals.pulls == 0 and s.loaded_blocks == 0
    assert len(sim.totals.ttft_ms) == 1 and sim.totals.ttft_ms[0] < 500.0 + 2 * sim._alone_ms(s.prompt)


def test_the_threshold_rule_is_sized_for_the_profile():
    slow = baseline_settings(Profile(), 8).route_min_cached_token_delta   # 70B KV over a 1.5 GB/s uplink
    assert slow == NEVER != RoutingSettings().route_min_cached_token_delta
    fast = baseline_settings(dataclasses.replace(Profile(), inter_rack_bytes_per_s=25 * GB), 8)
    assert 0 < fast.route_min_cached_token_delta < 512   # a pull pays after a few tokens at NIC speed


@needs_trace
def test_threshold_baselines_do_not_pull_where_no_pull_pays():
    r = summarize(run_one(spec("load-aware+p2p", requests=150)), 2000.0)
    assert r["pulls"] == 0   # at 512 tokens (sized for an 8B model) it pulled 70B KV over the slow uplink


def test_the_work_weight_stops_growing_with_the_queues():
    from tests.routing.test_policies import ctx, holder
    from control_plane.routing.types import Candidate

    busy = [Candidate("a", "a", waiting_requests=100), Candidate("b", "b", waiting_requests=100)]
    c = ctx(busy, [holder("a", cpu=10)])
    assert c.load_factor == 0.0   # no work weight given
    from control_plane.routing.policies import RouteContext
    capped = RouteContext(c.candidates, c.prompt, c.block_size, _match(c), c.cost, True, c.min_delta,
                          work_weight=1.0, work_waiting_cap=RoutingSettings().route_work_waiting_cap)
    assert capped.load_factor == pytest.approx(4.0)


def _match(c):
    from control_plane.model import PrefixMatch
    return PrefixMatch(c.prompt // c.block_size, [])


def test_the_sweep_has_token_aware_without_p2p_and_paired_intervals():
    assert "token-aware-nop2p" in VARIANTS
    base = [{"goodput_rps": g, "ttft_p50_ms": 0, "ttft_p90_ms": 0, "slo_attainment": 0} for g in (1, 2, 3, 4, 5)]
    other = [dict(r, goodput_rps=r["goodput_rps"] + d) for r, d in zip(base, (0.1, 0.2, 0.1, 0.2, 0.15))]
    d = paired(other, base)
    lo, hi = d["delta_goodput_rps_ci95"]
    assert d["delta_goodput_rps"] == pytest.approx(0.15) and 0 < lo < 0.15 < hi   # the windows' spread cancels
    assert verdict(d["delta_goodput_rps"], [lo, hi], higher_is_better=True) == "loses"
    assert verdict(0.0, [-1.0, 1.0], higher_is_better=True) == "tie"
