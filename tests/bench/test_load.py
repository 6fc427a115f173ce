"""`kvmesh bench load`, short: saturation with 1 and 2 replicas, one Redis and a Redis Cluster, a short soak."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh_apps.bench.load import slope_per_hour


def test_slope_per_hour():
    assert slope_per_hour([(0, 1.0), (1800, 2.0), (3600, 3.0)]) == pytest.approx(2.0)
    assert slope_per_hour([(0, 5.0), (60, 5.0)]) == 0.0
    assert slope_per_hour([(0, 5.0)]) == 0.0


@pytest.mark.slow
def test_load_and_short_soak():
    out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "bench", "load", "--json", "--seconds", "2",
                          "--clients", "1", "--concurrency", "8", "--streams", "2", "--replicas", "1,2",
                          "--soak-minutes", "0.25", "--soak-nodes", "6"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["lookups_per_s"]) == {"1", "2"} and all(v > 0 for v in result["lookups_per_s"].values())
    assert set(result["cluster"]["lookups_per_s"]) == {"1", "2"}
    assert result["lookup_p99_ms_at_saturation"] > 0
    assert result["stream_lookups_per_s"] > 0 and result["stream_lookup_p99_ms_at_saturation"] > 0
    assert result["batched_stream_lookups_per_s"] > 0 and result["batched_stream_lookup_p99_ms_at_saturation"] > 0
    assert result["stream_batch_lookups"] == 8 and result["control_plane_cpu_ms_per_batched_stream_lookup"] > 0
    soak = result["soak"]
    assert soak["minutes"] == 0.25 and soak["samples"] >= 6
    warm = soak["after_warmup"]  # the slopes are fitted over these samples (every 1.25 s here)
    assert warm["samples"] >= 6 and warm["interval_s"] == 1.25
    for series in ("rss_mib", "redis_mib", "fds"):
        assert warm[series]["max"] >= max(warm[series]["first"], warm[series]["last"]) > 0
    assert {"rss_slope_mib_per_h", "redis_slope_mib_per_h", "fd_slope_per_h"} <= set(soak)
    churn = soak["churn"]
    assert churn["join"] and churn["evict"] and churn["restart"] and churn["leave"]
