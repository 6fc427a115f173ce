"""`kvmesh bench replay` end to end on a slice of the real trace, and its building blocks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh_apps.replay.sim import Lru, variants
from kvmesh_apps.replay.trace import BlockHashes, TraceRequest, load_window

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"
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


def test_lru_reports_stored_and_evicted():
    lru = Lru(2)
    assert lru.insert([b"a", b"b"]) == ([b"a", b"b"], [])
    lru.touch([b"a"])
    assert lru.insert([b"c"]) == ([b"c"], [b"b"])
    assert b"a" in lru and b"b" not in lru


def test_nine_variants():
    assert {v.name for v in variants()} == NAMES


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not present")
def test_replay_ends_with_its_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "bench", "replay", "--trace", str(TRACE),
                          "--requests", "120", "--engines", "4", "--out", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["policies"]) == NAMES
    for name, r in result["policies"].items():
        for key in ("ttft_p50_ms", "ttft_p99_ms", "throughput_rps", "prefill_tokens_saved", "bytes_moved",
                    "stale_route_rate", "hit_rate_by_tier"):
            assert key in r, (name, key)
        assert r["requests"] == 120 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
    assert result["policies"]["no-sharing"]["prefill_tokens_saved"] == 0
    for name in NAMES - {"no-sharing"}:
        assert name.endswith("+p2p") or result["policies"][name]["bytes_moved"] == 0
    assert result["profile"]["kv_bytes_per_token"] > 0 and result["profile"]["engines"] == 4
    assert json.loads((tmp_path / "replay.json").read_text())["policies"].keys() == result["policies"].keys()
