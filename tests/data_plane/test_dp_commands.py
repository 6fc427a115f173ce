"""`kvmesh data-plane` refuses bad configuration clearly; `kvmesh bench pull --json` ends with its JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_data_plane_refuses_a_wildcard_without_advertise_address(shm_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh_apps.cli", "data-plane", "--node-id", "x", "--listen", "0.0.0.0:0",
         "--shm-dir", str(shm_dir)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not an address peers can reach; set advertise_address" in proc.stderr


@pytest.mark.nixl
@pytest.mark.slow
def test_bench_pull_json():
    proc = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "bench", "pull", "--json", "--rounds", "1",
                           "--idle-seconds", "2", "--small", "--lanes", "2"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("pull_gbps_2mib", "pull_gbps_64kib", "memcpy_gbps", "ratio_2mib", "peer_lookup_p50_ms",
                "acquire_ms_2mib", "raw_nixl_gbps_2mib", "raw_nixl_gbps_64kib", "pull_then_acquire_ms_2mib",
                "pull_pinned_ms_2mib", "pull_then_acquire_ms_64kib", "pull_pinned_ms_64kib"):
        assert result[key] > 0
    assert result["transfer_lanes"] == 2
    assert result["ratio_2mib"] == pytest.approx(result["pull_gbps_2mib"] / result["memcpy_gbps"], rel=1e-2)
    for size in ("2mib", "64kib"):  # the gated pull against NIXL alone moving the same bytes
        assert result[f"pull_vs_raw_nixl_{size}"] == pytest.approx(
            result[f"pull_gbps_{size}"] / result[f"raw_nixl_gbps_{size}"], rel=1e-2)
    assert 0 <= result["idle_cpu_fraction"] < 0.5  # a busy-polling NIXL progress thread shows as ~1.0
    assert result["coalesced_bytes_ratio"] == pytest.approx(1.0)
