"""The commands README names run end to end and end with the JSON they promise (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def run_kvmesh(*args: str, timeout: float = 300) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bench_control_plane_ends_with_its_json():
    result = run_kvmesh("bench", "control-plane", "--json", "--blocks", "2000", "--rounds", "20")
    for key in ("noop_rpc_p50_ms", "lookup_p50_ms", "lookup_p99_ms", "ingest_blocks_per_s", "redis_bytes_per_block",
                "versions"):
        assert key in result
    assert result["lookup_blocks"] == 1024 and result["lookup_holders"] == 8
    assert result["ingest_blocks_per_s"] > 0 and result["redis_bytes_per_block"] > 0


def test_usage_and_unknown_commands():
    ok = subprocess.run([sys.executable, "-m", "kvmesh.cli", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "bench NAME" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "kvmesh.cli", "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
    bad_flag = subprocess.run([sys.executable, "-m", "kvmesh.cli", "control-plane", "--lease-ms", "5"],
                              capture_output=True, text=True, timeout=60)
    assert bad_flag.returncode == 2 and "invalid configuration" in bad_flag.stderr


def test_demo_reports_who_holds_the_prefix():
    result = run_kvmesh("demo", "--json")
    assert result["best_source"] == "node-1"
    assert result["holders"] == {"node-1": 36, "node-2": 32}
