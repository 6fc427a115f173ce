"""``kvmesh bench prefetch``: a short run end to end (real vLLM CPU engines in network namespaces over a tc-shaped
link; root, slow) ends with the issue's JSON object, and the prefetches it reports were started, landed and used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench.test_routing import needs_root


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_root
def test_short_run_ends_with_the_issues_json():
    out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "bench", "prefetch", "--json", "--repetitions", "2",
                          "--requests", "3"], capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for mode in ("recompute", "pull", "prefetch"):
        figures = result["modes"][mode]
        assert figures["ttft_p90_ms"]["mean"] >= figures["ttft_p50_ms"]["mean"] > 0
        assert len(figures["ttft_p50_ms"]["per_repetition"]) == 2 and figures["ttft_p50_ms"]["ci95"] is not None
    delta = result["paired_delta_p50_ms"]
    assert delta["ci95"][0] <= delta["mean"] <= delta["ci95"][1]
    # the orders reached n2 and its data plane pulled: bytes prefetched, the engine used them, none wasted here
    assert result["prefetch_statuses"].get("STARTED") == 6, result["prefetch_statuses"]
    assert result["bytes_prefetched"] > 0 and result["bytes_used"] == result["bytes_prefetched"]
    assert result["wasted_bytes_fraction"] == 0.0
    # pull-on-ask pulled through the connector; recompute pulled nothing
    assert result["modes"]["pull"]["connector"]["peer_tokens"] == 6 * result["prefix_tokens"]
    assert result["modes"]["recompute"]["connector"]["bytes_pulled"] == 0
    assert result["link"]["mbit"] > 0 and result["arrival_spacing_ms"] > 0
