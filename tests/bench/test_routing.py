"""``kvmesh bench routing``: its statistics as plain functions, bad input in one line, and ``--quick`` end to end
(real vLLM CPU engines in network namespaces over tc-shaped links; root, slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvmesh_apps.bench import routing
from kvmesh_apps.bench.conversation_windows import conversation_window
from kvmesh_apps.bench.sim_to_real import paired_verdicts, rank_agreement, sign_agreement
from tests.replay.test_replay import TRACE, needs_trace

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not all(map(shutil.which, ("ip", "tc", "iptables"))),
                                reason="network namespaces need root, iproute2 and iptables")
POLICY_KEYS = {"ttft_p50_ms", "ttft_p90_ms", "goodput_rps"}


def test_rank_agreement_counts_ties_as_verdicts():
    real = {"cost-aware": 100.0, "a": 102.0, "b": 200.0}
    # a ties cost-aware (its paired interval holds 0): a simulation calling it a tie agrees, list order aside
    assert rank_agreement(real, {"cost-aware": 100.0, "a": 101.0, "b": 300.0}, {"a": [-5.0, 9.0], "b": [90, 110]}) == 1.0
    assert rank_agreement(real, {"cost-aware": 100.0, "a": 150.0, "b": 300.0}, {"a": [-5.0, 9.0], "b": [90, 110]}) \
        == pytest.approx(2 / 3, abs=1e-3)
    assert rank_agreement({"b": 1.0, "a": 1.0}, {"a": 1.0, "b": 1.0}) == 1.0   # tied both ways in any order


def test_paired_verdicts_tie_when_the_paired_interval_holds_zero():
    units = {"cost-aware": [100.0, 200.0, 300.0], "same": [101.0, 198.0, 301.0], "slower": [150.0, 260.0, 340.0]}
    v = paired_verdicts(units)
    assert v == {("cost-aware", "same"): 0, ("cost-aware", "slower"): -1, ("same", "slower"): -1}
    # the simulator's verdicts: it calls "same" slower than cost-aware; one pair of three disagrees
    sim = paired_verdicts({"cost-aware": [100.0, 200.0, 300.0], "same": [125.0, 225.0, 320.0],
                           "slower": [150.0, 260.0, 340.0]})
    assert sign_agreement(v, sim) == pytest.approx(2 / 3, abs=1e-3)
    assert sign_agreement(v, v) == 1.0


def test_sim_to_real_predicts_p50s_and_paired_differences():
    real = {"cost-aware": [100.0, 200.0, 300.0], "never-pull": [150.0, 240.0, 360.0]}
    sim = {"cost-aware": [110.0, 190.0, 330.0], "never-pull": [160.0, 250.0, 370.0]}
    out = routing.sim_to_real(real, sim)
    d = out["paired_vs_cost_aware"]["never-pull"]
    assert d["real_delta_p50_ms"] == pytest.approx(50.0) and d["sim_delta_p50_ms"] == pytest.approx(50.0)
    assert d["real_ci_holds_sim"] and d["delta_error_ms_p50"] == pytest.approx(20.0)
    assert out["rank_agreement"] == 1.0 and out["max_p50_error"] == pytest.approx(0.05)   # 10 ms on 200
    assert out["p50_error_over_repetitions"]["cost-aware"]["max"] == pytest.approx(0.1)


def test_a_link_fit_takes_the_line_through_its_pulls_and_says_when_it_falls_back():
    fixed, rate, fell_back = routing.fit_link([(1e6, 110.0), (1e6, 90.0), (8e6, 180.0), (8e6, 160.0)])
    assert not fell_back and fixed == pytest.approx(90.0) and rate == pytest.approx(1e8)   # 70 ms per 7 MB
    fixed, rate, fell_back = routing.fit_link([(1e6, 150.0), (8e6, 120.0)])   # noise hides the bytes' time
    assert fell_back and fixed == 0.0 and rate == pytest.approx(8e6 / 0.12)


def test_the_simulators_prefill_cost_is_fitted_on_the_runs_recomputes_only():
    recomputes = [routing.Served(n + 32, "n1", None, 0, 0, 0.0, engine_ms=20.0 + 0.5 * n, cached=32)
                  for n in (100, 400, 900)]
    pulled = routing.Served(900, "n2", "n1", 0, 800, 0.0, engine_ms=5000.0, cached=896, peer_tokens=800)
    costs = routing.served_costs({("cost-aware", 1.0, 0): recomputes + [pulled]})
    assert costs.overhead_ms == pytest.approx(20.0) and costs.ms_per_token == pytest.approx(0.5)


def test_conversation_windows_gather_follow_ups_with_their_previous_turns(tmp_path):
    from tests.replay.test_trace import write
    rows = []   # conversations 100, 200, 300: 1,024, then 2,048 trace tokens; 20 one-off requests between
    for k in range(26):
        conv = {3: 100, 9: 200, 12: 300, 17: 100, 22: 200, 24: 300}.get(k)
        turn2 = k in (17, 22, 24)
        ids = [0, conv, conv + 1] + ([conv + 2, conv + 3] if turn2 else []) if conv else [0, 1000 + k]
        rows.append({"timestamp": 1000 * k, "input_length": 512 * len(ids), "output_length": 5, "hash_ids": ids})
    rows.append({"timestamp": 30_000, "input_length": 512 * 40, "output_length": 5, "hash_ids": list(range(40))})
    w = conversation_window(write(tmp_path / "t.jsonl", rows), 0, 27, 6, 32, 256)
    assert [r.arrival_ms for r in w.requests] == [0, 6000, 9000, 14000, 19000, 21000]   # trace order and gaps
    assert w.follow_ups == 3 and w.shared_tokens == [0, 0, 0, 96, 96, 96] and w.previous == [None] * 3 + [0, 1, 2]
    assert [r.input_tokens for r in w.requests] == [96, 96, 96, 160, 160, 160]   # 32 tokens a trace block
    # more than the conversations: the earliest one-off requests fill the window; the 40-block one never fits
    w = conversation_window(write(tmp_path / "t.jsonl", rows), 0, 27, 8, 32, 256)
    assert len(w.requests) == 8 and w.follow_ups == 3 and w.requests[0].input_tokens == 64


def test_the_oracle_and_the_audit_use_measured_figures():
    m = routing.Measured(routing.FittedCosts(0.0, 1.0, 0.0), 1000.0, {("n1", "n2"): 10.0, ("n2", "n1"): 10.0},
                         {("n1", "n2"): 1e6, ("n2", "n1"): 1e6})
    kv = 1000   # 1 ms a token on the wire, 1 ms a token to prefill: a pull of t tokens costs 10 + t, saves t
    pulled = routing.Served(600, "n2", "n1", 0, 500, estimate_ms=600.0, engine_ms=520.0, pulled_bytes=5e5,
                            best_peer=("n1", 500))
    stayed = routing.Served(600, "n2", None, 0, 0, estimate_ms=300.0, engine_ms=600.0, best_peer=("n1", 500))
    a = routing.audit({"cost-aware": [[pulled, stayed]]}, m, kv)
    assert a["pulls"] == 1 and a["recomputes"] == 1
    assert a["pull_error_p50"] == pytest.approx(80 / 520, abs=1e-3) and a["recompute_error_p50"] == -0.5
    assert a["oracle_disagreements"] == 1 and a["oracle_decisions"] == 2   # 510 + 100 > 600: stay; one pulled
    cheap = routing.Measured(m.costs, 1000.0, {k: 0.0 for k in m.link_fixed_ms}, {k: 1e7 for k in m.link_bytes_per_s})
    assert routing.audit({"cost-aware": [[pulled, stayed]]}, cheap, kv)["oracle_disagreements"] == 1   # now: stayed


def test_bad_input_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    from tests.replay.test_trace import one_line_error, trace_of

    class Started(Exception):
        pass

    def build_tiny_llama(*_, **__):
        raise Started
    monkeypatch.setattr(routing, "build_tiny_llama", build_tiny_llama)
    trace = trace_of(tmp_path / "t.jsonl", 10)
    for argv, reason in [
        (["--trace", str(tmp_path / "missing.jsonl")], "cannot read the trace"),
        (["--trace", str(trace), "--policies", "fastest"], "argument --policies: unknown 'fastest'"),
        (["--trace", str(trace), "--paces", "0"], "argument --paces"),
        (["--trace", str(trace), "--nodes", "1"], "--nodes: at least 2"),
    ]:
        assert reason in one_line_error(routing.main, argv, capsys, routing.PROG), argv
    if os.geteuid() == 0:
        with pytest.raises(Started):   # positive control: valid input goes on to build the model
            routing.main(["--trace", str(trace), "--requests", "4"])


@pytest.mark.slow
@pytest.mark.timeout(1500)
@needs_root
@needs_trace
def test_quick_run_ends_with_the_issues_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "bench", "routing", "--quick", "--trace",
                          str(TRACE), "--json"], capture_output=True, text=True, timeout=1400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["policies"]) == set(routing.POLICIES)
    assert all(set(r) >= POLICY_KEYS and r["ttft_p90_ms"] >= r["ttft_p50_ms"] > 0 for r in result["policies"].values())
    assert set(result["paired_vs_cost_aware"]) == set(routing.POLICIES) - {"cost-aware"}
    for d in result["paired_vs_cost_aware"].values():
        assert d["ci95_p50_ms"][0] <= d["delta_p50_ms"] <= d["ci95_p50_ms"][1]
    assert result["repetitions"] == 2
    assert set(result["decision_audit"]) >= {"pull_error_p50", "recompute_error_p50", "oracle_disagreements"}
    # pulls work: the calibration pulls every link (it stops the bench when one moves nothing); never-pull never does
    assert result["policies"]["never-pull"]["pulls"] == 0 and all(result["setup"]["link_bytes_per_s"].values())
    assert 0 <= result["sim_to_real"]["rank_agreement"] <= 1 and result["sim_to_real"]["max_p50_error"] >= 0
    assert result["setup"]["link_bytes_per_s"]["n1>n2"] > 3 * result["setup"]["link_bytes_per_s"]["n1>n3"]
