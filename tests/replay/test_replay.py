"""`kvmesh bench replay`: its building blocks, behaviours that can fail, and the CLI end to end."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh_apps.replay.costs import LAYERS, LINEAR_MS, StepCosts
from kvmesh_apps.replay.engine import Tier
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.runs import RunSpec, max_slo_rate, run_one, summarize
from kvmesh_apps.replay.sim import variants
from kvmesh_apps.replay.trace import BlockHashes, TraceRequest, load_window

_TRACES = [d / "shared" / "traces" / "conversation_trace.jsonl" for d in Path(__file__).resolve().parents]
# The project's shared/ beside the checkout; else the trace's first 1,000 requests, committed for a clone without it
# (tests/data/README.md says where they come from).
HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head.jsonl"
TRACE = next((t for t in _TRACES if t.exists()), HEAD)
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="no Mooncake trace (shared/ or tests/data)")
NAMES = {"cost-aware+p2p", "token-aware+p2p", "load-aware+p2p", "affinity+p2p", "cost-aware-nop2p",
         "token-aware-nop2p", "load-aware-nop2p", "affinity-nop2p", "no-sharing"}


def test_block_hashes_are_chained_and_cover_full_blocks_only():
    h = BlockHashes()
    a = h.of(TraceRequest(0, 3 * 512 + 7, 1, (0, 1, 2, 3)))
    b = h.of(TraceRequest(0, 2 * 512, 1, (0, 1, 9)))
    assert len(a) == 3 and len(b) == 2 and a[:2] == b and all(len(x) == 32 for x in a)
    assert h.of(TraceRequest(0, 512, 1, (1,))) != a[:1]  # same id, other position: another hash


def test_window_is_contiguous_and_shifted(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 5,
                                         "hash_ids": [i, i + 1]}) + "\n" for i in range(10)))
    window = load_window(trace, start=3, count=4, time_scale=2.0)
    assert [r.arrival_ms for r in window] == [0, 500, 1000, 1500] and window[0].hash_ids == (3, 4)


def test_a_tier_evicts_a_chain_tail_first_and_never_a_pinned_block():
    tier = Tier(4)
    assert tier.insert([b"h", b"m", b"t"]) == [b"t", b"m", b"h"]
    tier.insert([b"x"])
    assert tier.evict(1) == [b"t"]            # the tail goes first; head-first LRU would drop b"h"
    assert tier.leading([b"h", b"m", b"t"]) == 2
    tier.pins[b"m"] += 1
    assert tier.evict(2) == [b"h", b"x"]      # b"m" is pinned
    assert b"m" in tier and len(tier) == 1


def test_step_costs_come_from_the_table_and_grow_with_context():
    c = StepCosts()
    assert c.dense_ms(2048) > LAYERS * dict(LINEAR_MS)[2048]   # the table's operators plus the all-reduces
    assert c.step_ms(2048, [(2048, 30_000)], 0) > 1.5 * c.step_ms(2048, [(2048, 0)], 0)
    assert c.step_ms(32, [], 32 * 16_000) > c.step_ms(32, [], 32 * 1_000)
    assert StepCosts(speed=2.0).step_ms(512, [(512, 0)], 0) == pytest.approx(c.step_ms(512, [(512, 0)], 0) / 2)
    fresh = c.prefill_alone_ms(16_384, 0, 2048)
    assert c.prefill_alone_ms(16_384, 16_384, 2048) > fresh   # the same tokens after a long cached prefix cost more


def test_max_slo_rate_interpolates_at_the_crossing():
    assert max_slo_rate([(1.0, 0.99), (2.0, 0.95), (3.0, 0.85)]) == pytest.approx(2.5)
    assert max_slo_rate([(1.0, 0.5)]) < 1.0 and max_slo_rate([(1.0, 0.95), (2.0, 0.92)]) == 2.0


def test_nine_variants():
    assert {v.name for v in variants()} == NAMES


def spec(variant: str, **changes) -> RunSpec:
    base = RunSpec(str(TRACE), variant, Profile(), engines=4, start=0, requests=300, time_scale=1.0,
                   event_delay_ms=50.0)
    profile = {k: changes.pop(k) for k in list(changes) if hasattr(Profile(), k)}
    return dataclasses.replace(base, profile=dataclasses.replace(Profile(), **profile), **changes)


@needs_trace
def test_a_tiny_cpu_tier_makes_stale_routes():
    kw = dict(event_delay_ms=2000.0, engines=8, requests=600, min_cached_token_delta=512)   # a rule that pulls
    tiny = summarize(run_one(spec("load-aware+p2p", cpu_tier_blocks=60, **kw)), 2000.0)
    assert tiny["stale_route_rate"] > 0
    roomy = summarize(run_one(spec("load-aware+p2p", **kw)), 2000.0)   # negative control
    assert roomy["stale_route_rate"] == 0


@needs_trace
def test_pulls_slower_than_recompute_save_nothing():
    slow = run_one(spec("load-aware+p2p", inter_rack_bytes_per_s=0.05e9, nic_bytes_per_s=0.05e9,
                        min_cached_token_delta=512))   # a threshold sized for another model's KV
    r = summarize(slow, 2000.0)
    assert r["pulls_slower_than_recompute"] > 0 and slow.slow_pull_tokens > 0
    assert r["prefill_tokens_saved"] == slow.prompt_tokens - slow.computed_tokens - slow.slow_pull_tokens
    fast = summarize(run_one(spec("load-aware+p2p", inter_rack_bytes_per_s=25e9, min_cached_token_delta=512)),
                     2000.0)
    assert fast["pulls_slower_than_recompute"] < r["pulls_slower_than_recompute"]


@needs_trace
def test_goodput_ranking_under_overload_is_stable_across_seeds():
    """Three noise seeds past saturation (under half the requests meet the SLO): cost-aware+p2p first every time.
    (load-aware-nop2p and no-sharing are within 0.05 req/s of each other in one seed since pulls share links and
    time out: they are no longer a clear gap; cost-aware+p2p and affinity trade places: docs/scheduling.md.)"""
    names = ["cost-aware+p2p", "load-aware-nop2p", "no-sharing"]
    for seed in range(3):
        rows = {n: summarize(run_one(spec(n, engines=8, requests=800, time_scale=1.75, seed=seed)), 2000.0)
                for n in names}
        assert all(r["slo_attainment"] < 0.5 for r in rows.values())
        assert max(names, key=lambda n: rows[n]["goodput_rps"]) == "cost-aware+p2p", rows


@needs_trace
def test_replay_ends_with_its_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "bench", "replay", "--trace", str(TRACE),
                          "--requests", "150", "--windows", "2", "--engines", "4", "--sweep-requests", "100",
                          "--sweep-params", "inter_rack_gbytes_per_s", "--sweep-loads", "1,2",
                          "--sweep-variants", "cost-aware+p2p,affinity+p2p", "--control-plane", "real",
                          "--out", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["policies"]) == NAMES
    for name, r in result["policies"].items():
        assert r["requests"] == 150 and r["windows"] == 2
        assert r["ttft_p99_ms"] >= r["ttft_p90_ms"] >= r["ttft_p50_ms"] > 0 and "goodput_rps_ci95" in r
    assert result["policies"]["no-sharing"]["prefill_tokens_saved"] == 0
    # the first window again through a real control-plane process: every variant, real Route RPCs
    assert set(result["control_plane"]) == NAMES
    assert all(r["requests"] == 150 and r["route_ms_p50"] > 0 for r in result["control_plane"].values())
    for name in NAMES - {"no-sharing"}:
        assert name.endswith("+p2p") or result["policies"][name]["bytes_moved"] == 0
    assert result["profile"]["kv_bytes_per_token"] == 327_680 and result["profile"]["engines"] == 4
    points = [p["point"] for p in result["sweep"]]
    assert {"time_scale": 2.0, "arrival_rate_rps": points[1]["arrival_rate_rps"]} in points
    assert {"inter_rack_gbytes_per_s": 25.0} in points and len(points) == 2 + 5
    for p in result["sweep"]:
        assert set(p["policies"]) == {"cost-aware+p2p", "affinity+p2p"}
        for r in p["policies"].values():
            assert {"goodput_rps", "max_slo_rate_rps", "ttft_p50_ms", "ttft_p99_ms"} <= set(r)
    assert (tmp_path / "replay.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "replay.json").read_text())["policies"].keys() == result["policies"].keys()


def test_fitted_costs_recover_a_known_engine():
    from kvmesh_apps.replay.costs import FittedCosts

    true = FittedCosts(12.0, 0.05, 2e-5)
    fit = FittedCosts.fit([(n, true.step_ms(n, [(n, 0)], 0)) for n in (64, 256, 512, 1024, 2048)])
    assert (fit.overhead_ms, fit.ms_per_token, fit.ms_per_token_context) == pytest.approx((12.0, 0.05, 2e-5), rel=1e-6)


def test_scaled_prompts_share_exactly_the_prefixes_the_trace_shares():
    from kvmesh_apps.bench.sim_to_real import Prompts

    prompts = Prompts(vocab=2048, block_tokens=64, salt=1)
    a = prompts.of(TraceRequest(0, 3 * 64 + 10, 1, (0, 1, 2, 3)), 0)
    b = prompts.of(TraceRequest(0, 2 * 64 + 5, 1, (0, 1, 9)), 1)
    assert len(a) == 202 and len(b) == 133 and a[:128] == b[:128] and a[128:] != b[128:133]
    other = Prompts(vocab=2048, block_tokens=64, salt=2).of(TraceRequest(0, 64, 1, (0,)), 0)
    assert other != a[:64]   # another salt (another policy's run): nothing shared
