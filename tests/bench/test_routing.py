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
from kvmesh_apps.bench.sim_to_real import rank_agreement
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
