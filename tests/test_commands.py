"""The commands README names run end to end and end with the JSON they promise (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_kvmesh(*args: str, timeout: float = 300) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bench_control_plane_ends_with_its_json(monkeypatch):
    # A 4 s node lease (the default is 10 s) makes the run outlive several leases: its nodes must heartbeat
    # (before they did, this run ended in IndexError). Not shorter: with a 1 s lease one Redis stall of the
    # busy machine (2 s socket timeout) expired the prompt's holders and GC swept their 1,024 blocks.
    monkeypatch.setenv("KVMESH_CP_LEASE_MS", "4000")
    result = run_kvmesh("bench", "control-plane", "--json", "--blocks", "2000", "--rounds", "400")
    for key in ("noop_rpc_p50_ms", "lookup_p50_ms", "lookup_p99_ms", "lookup_p50_over_noop_p50",
                "ingest_blocks_per_s", "redis_bytes_per_block", "control_plane_cpu_ms_per_noop",
                "control_plane_cpu_ms_per_lookup", "redis_ms_per_lookup", "versions"):
        assert key in result
    for key in ("bare_grpc_noop_p50_ms", "bare_grpc_cpu_ms_per_noop", "bare_grpc_redis_call_p50_ms",
                "bare_grpc_cpu_ms_per_redis_call", "health_check_p50_ms",
                "control_plane_cpu_ms_per_health_check", "lookup_1_block_p50_ms",
                "control_plane_cpu_ms_per_1_block_lookup", "lookup_repeated_p50_ms",
                "lookup_repeated_p50_over_noop_p50", "control_plane_cpu_ms_per_lookup_repeated",
                "replica_lookup_p50_us", "replica_bytes_per_block",
                "replica_lag_samples"):
        assert result[key] > 0, key
    # Lookups answer from the control plane's in-memory replica: Redis runs no lookup script for them.
    assert result["redis_ms_per_1_block_lookup"] >= 0 and result["redis_ms_per_lookup"] >= 0
    assert result["replica_lag_p99_ms"] >= 0
    assert result["replica_lookup_holders"] == 8 and result["replica_lookup_longest"] == 1024
    assert result["replica_blocks"] == 1024 + 2000
    assert result["auth_cost_p50_ms"] == pytest.approx(result["noop_rpc_p50_ms"] - result["health_check_p50_ms"],
                                                       abs=0.002)
    assert result["lookup_1_block_over_noop_p50"] > 0
    assert result["lookup_blocks"] == 1024 and result["lookup_holders"] == 8
    assert result["ingest_blocks_per_s"] > 0 and result["redis_bytes_per_block"] > 0
    assert result["node_lease_ms"] == 4000 and result["node_heartbeat_rounds"] >= 3


def test_usage_and_unknown_commands():
    ok = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "bench NAME" in ok.stdout
    for asked in ("--help", "-h", "help"):  # the benchmarks' list, as a new user asks for it
        bench = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "bench", asked], capture_output=True,
                               text=True)
        assert bench.returncode == 0 and "usage: kvmesh bench NAME" in bench.stdout, bench.stderr
        assert "scale " in bench.stdout and "pull " in bench.stdout and not bench.stderr
    bad = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
    bad_flag = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "control-plane", "--lease-ms", "5"],
                              capture_output=True, text=True, timeout=60)
    assert bad_flag.returncode == 2 and "invalid configuration" in bad_flag.stderr


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_demo_pulls_prefixes_between_engines_with_identical_outputs(tmp_path):
    """The demo's scenario on the small model (the default model only changes timings): every turn
    after the first finds its prefix on the other node, pulls it and matches a cold recompute (tokens and
    logprobs); ``--check``'s negative control (a misplaced block) fails that comparison."""
    result = run_kvmesh("demo", "--json", "--check", "--model", "tiny", "--model-dir", str(tmp_path / "models"),
                        "--sessions", "2", "--turns", "2", "--prefix-tokens", "640", timeout=900)
    for key in ("external_hit_rate", "outputs_match", "max_logprob_diff", "ttft_pull_ms", "ttft_recompute_ms",
                "bytes_pulled", "prefix_tokens", "hit_rate_by_tier"):
        assert key in result
    assert result["outputs_match"] is True and result["max_logprob_diff"] <= result["logprob_tolerance"]
    # The negative control: an engine that misplaces one loaded block fails the same comparison.
    assert result["negative_control_loaded_tokens"] > 0 and result["negative_control_failed"] is True
    assert result["requests"] == 4 and result["requests_pulled"] >= 2
    assert result["external_hit_rate"] >= 0.9
    assert result["bytes_pulled"] >= result["tokens_pulled"] // 32 * result["block_bytes"] > 0
    # Turn 2 of session 0 runs on engine b: the system prompt is already in dp2's tier (session 1 pulled it),
    # the rest of the history is pulled from dp1, where engine a computed it.
    (s0t2,) = [t for t in result["turns"] if t["session"] == 0 and t["turn"] == 2]
    assert s0t2["engine"] == "b" and s0t2["source"] == "dp1" and s0t2["peer_tokens"] > 0
    assert s0t2["local_tokens"] + s0t2["peer_tokens"] >= 640
