"""Traces in other units than Mooncake's: Alibaba's Qwen traces (timestamps in seconds, one hash id per 16 tokens)
replay with --trace-block-tokens and --trace-time-unit, are refused without them in one line naming the flag, and
never pass silently as milliseconds; the default (512-token blocks, ms) is unchanged."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh_apps.bench import sim_to_real
from kvmesh_apps.bench.conversation_windows import conversation_window
from kvmesh_apps.replay import bench
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.trace import TraceError, TraceFormat, load_window, scan
from tests.doc_blocks import doc_block
from tests.replay.test_trace import TINY, Started, one_line_error, stop_before_engines, trace_of, write

QWEN = ["--trace-block-tokens", "16", "--trace-time-unit", "s"]


def qwen_trace(path: Path, n: int, gap_s: float = 0.5) -> Path:
    """``n`` rows in the shape of Alibaba's qwen_traceA_blksz_16.jsonl: a float timestamp in seconds (``gap_s``
    apart), one hash id per 16-token block; every other request is a follow-up turn whose prompt extends its
    parent's (its hash ids start with the parent's)."""
    rows, next_id = [], 0
    for i in range(n):
        parent = rows[-1] if i % 2 else None
        tokens = (parent["input_length"] if parent else 0) + 700 + 13 * (i % 5)
        ids = list(parent["hash_ids"]) if parent else []
        while len(ids) < -(-tokens // 16):
            ids.append(next_id)
            next_id += 1
        rows.append({"chat_id": i, "parent_chat_id": i - 1 if parent else -1, "timestamp": 1000.125 + gap_s * i,
                     "input_length": tokens, "output_length": 40 + i % 7, "type": "text", "turn": 2 if parent else 1,
                     "hash_ids": ids})
    return write(path, rows)


def _replay(argv: list[str], capsys) -> tuple[dict, list[str]]:
    assert bench.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    return json.loads(out[-1]), out


def test_a_seconds_trace_of_16_token_blocks_replays_with_the_flags(tmp_path, capsys):
    trace = qwen_trace(tmp_path / "qwen_traceA_blksz_16.jsonl", 80)
    result, out = _replay(["--trace", str(trace), *QWEN, *TINY, "--requests", "40", "--windows", "2",
                           "--out", str(tmp_path / "o"), "--json"], capsys)
    t = result["trace"]
    assert (t["block_tokens"], t["time_unit"], t["windows"]) == (16, "s", [0, 40])
    assert t["arrival_rate_rps"] == pytest.approx(40 / 19.5, abs=1e-3) and t["peak_requests_per_s"] == 2   # 0.5 s apart
    assert "full 16-token blocks only" in t["block_hashes"]
    assert "2.05 requests/s, at most 2 in a second (timestamps in s, 16 tokens a hash id)" in out[0]
    assert result["profile"]["block_tokens"] == 16 and result["profile"]["gpu_kv_blocks"] == 880
    shared = result["policies"]["cost-aware+p2p"]
    assert shared["requests"] == 40 and shared["prefill_tokens_saved"] > 0   # follow-ups found their prefix
    assert result["policies"]["no-sharing"]["prefill_tokens_saved"] == 0


def test_without_the_flags_it_is_refused_in_one_line_naming_the_flag(tmp_path, capsys):
    trace = qwen_trace(tmp_path / "qwen.jsonl", 1200)
    args = [*TINY, "--out", str(tmp_path / "o")]
    err = one_line_error(bench.main, ["--trace", str(trace), *args], capsys)
    assert (f"{trace}, line 1: hash_ids: 44 ids for input_length 700, not one per 512-token block (that is 1 or 2): "
            "its ids imply 16-token blocks; replay with --trace-block-tokens 16") in err
    err = one_line_error(bench.main, ["--trace", str(trace), "--trace-block-tokens", "32", *args], capsys)
    assert "its ids imply 16-token blocks; replay with --trace-block-tokens 16" in err
    # its block size right but its seconds read as ms: 1,200 requests in 0.6 s
    err = one_line_error(bench.main, ["--trace", str(trace), "--trace-block-tokens", "16", "--requests", "1200",
                                      *args], capsys)
    assert (f"{trace}: 1200 of requests 0 to 1199 arrive within one second (timestamps read as ms), more than 1000 a "
            "second, far above any real deployment's trace: --trace-time-unit s if its timestamps are seconds") in err
    err = one_line_error(bench.main, ["--trace", str(trace), "--trace-block-tokens", "16", "--requests", "10",
                                      "--sweep-requests", "1200", "--out", str(tmp_path / "o")], capsys)
    assert "1200 of requests 0 to 1199 arrive within one second (timestamps read as ms)" in err   # the sweep's
    assert scan(trace, TraceFormat(16, "s")).requests == 1200   # control: read as it is, it passes


def test_a_small_window_read_in_the_wrong_unit_says_its_rate(tmp_path, capsys):
    """Under 1,001 requests the guard cannot tell; the rate it implies is printed and in the JSON."""
    trace = qwen_trace(tmp_path / "qwen.jsonl", 20)
    result, out = _replay(["--trace", str(trace), "--trace-block-tokens", "16", *TINY, "--requests", "20",
                           "--windows", "1", "--out", str(tmp_path / "o"), "--json"], capsys)
    assert result["trace"]["time_unit"] == "ms"
    assert result["trace"]["arrival_rate_rps"] == pytest.approx(20 / 0.0095, abs=1e-3)   # 0.5 s read as 0.5 ms
    assert "2.11e+03 requests/s, at most 20 in a second (timestamps in ms, 16 tokens a hash id)" in out[0]


@pytest.mark.parametrize("flag, value, reason", [
    ("--trace-block-tokens", "0", "must be an integer from 1 to 4096"),
    ("--trace-block-tokens", "-16", "must be an integer from 1 to 4096"),
    ("--trace-block-tokens", "16.5", "must be an integer from 1 to 4096"),
    ("--trace-block-tokens", "4097", "must be an integer from 1 to 4096"),
    ("--trace-time-unit", "h", "invalid choice: 'h' (choose from 'ms', 's')"),
    ("--trace-time-unit", "", "invalid choice: ''"),
])
def test_bad_flag_values_exit_2_with_one_line(tmp_path, capsys, flag, value, reason):
    trace = trace_of(tmp_path / "t.jsonl", 30)
    err = one_line_error(bench.main, ["--trace", str(trace), f"{flag}={value}", *TINY], capsys)
    assert f"argument {flag}: {reason}" in err, err


def test_a_seconds_trace_replays_as_its_milliseconds_twin(tmp_path, capsys):
    """The same arrivals written in seconds, read with --trace-time-unit s: the same windows, the same figures."""
    ms = trace_of(tmp_path / "ms.jsonl", 60)
    rows = [json.loads(line) for line in ms.read_text().splitlines()]
    s = write(tmp_path / "s.jsonl", [{**r, "timestamp": r["timestamp"] / 1000} for r in rows])
    assert load_window(s, 5, 20, fmt=TraceFormat(time_unit="s")) == load_window(ms, 5, 20)
    args = [*TINY, "--requests", "30", "--windows", "2", "--json"]
    by_ms, _ = _replay(["--trace", str(ms), *args, "--out", str(tmp_path / "a")], capsys)
    by_s, _ = _replay(["--trace", str(s), "--trace-time-unit", "s", *args, "--out", str(tmp_path / "b")], capsys)
    for figures in (by_ms["policies"], by_s["policies"]):
        for p in figures.values():
            p.pop("route_ms_p50")   # the router's own wall time
    assert by_s["policies"] == by_ms["policies"] and by_ms["trace"]["time_unit"] == "ms"


def test_kv_memory_is_the_same_whatever_the_block_size(tmp_path, capsys):
    """--gpu-kv-blocks and --cpu-tier-blocks count 512-token blocks: with 16-token blocks an engine holds 32 times as
    many, the same bytes; a request larger than that memory is refused saying both."""
    default, small = Profile(), dataclasses.replace(Profile(), block_tokens=16)
    assert (default.gpu_blocks, default.cpu_blocks) == (880, 3200)
    assert (small.gpu_blocks, small.cpu_blocks) == (880 * 32, 3200 * 32)
    assert small.gpu_blocks * small.block_bytes == default.gpu_blocks * default.block_bytes
    trace = qwen_trace(tmp_path / "qwen.jsonl", 10)   # the largest (line 10): 1,491 + 42 prompt and output tokens
    err = one_line_error(bench.main, ["--trace", str(trace), *QWEN, *TINY, "--gpu-kv-blocks", "2", "--out",
                                      str(tmp_path / "o")], capsys)
    assert ("needs 96 KV blocks of 16 tokens, more than an engine holds (--gpu-kv-blocks 2: 64 blocks of 16 "
            "tokens): raise --gpu-kv-blocks") in err


def test_sim_to_real_reads_the_trace_with_the_same_flags(tmp_path, capsys, monkeypatch):
    stop_before_engines(monkeypatch)
    trace = qwen_trace(tmp_path / "qwen.jsonl", 40)
    err = one_line_error(sim_to_real.main, ["--trace", str(trace)], capsys, "kvmesh bench sim-to-real")
    assert "its ids imply 16-token blocks; replay with --trace-block-tokens 16" in err
    window = sim_to_real.scaled_window(trace, 0, 4, 32, 4096, 1, TraceFormat(16, "s"))
    assert [r.input_tokens for r in window] == [700 * 2, 1413 * 2, 726 * 2, 1465 * 2]  # a 16-token id: 32 tokens
    assert window[1].arrival_ms - window[0].arrival_ms == 500.0
    with pytest.raises(Started):   # valid input goes on to build the model
        sim_to_real.main(["--trace", str(trace), *QWEN])


def test_a_trace_error_names_the_unit_it_read(tmp_path):
    trace = write(tmp_path / "t.jsonl", [{"timestamp": "soon", "input_length": 20, "output_length": 1,
                                          "hash_ids": [1]}])
    with pytest.raises(TraceError, match=r"line 1: timestamp: must be a number \(s\)"):
        scan(trace, TraceFormat(16, "s"))


def test_conversation_windows_scale_the_trace_blocks_they_are_given(tmp_path):
    """kvmesh bench routing's windows: each 16-token trace block becomes --block-tokens tokens, follow-ups found."""
    trace = qwen_trace(tmp_path / "qwen.jsonl", 20)
    w = conversation_window(trace, 0, 20, 6, 32, 4096, TraceFormat(16, "s"))
    assert [r.input_tokens for r in w.requests[:2]] == [700 * 2, 1413 * 2]
    assert w.follow_ups == 3 and w.previous[:2] == [None, 0] and w.shared_tokens[1] == 700 // 16 * 32


def test_the_docs_qwen_example_runs_as_written(tmp_path):
    """docs/scheduling.md's replay-qwen-trace, on a synthetic trace of that name in the reader's directory."""
    qwen_trace(tmp_path / "qwen_traceA_blksz_16.jsonl", 400)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + doc_block("replay-qwen-trace")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["trace"]["windows"] == [0, 200] and result["trace"]["block_tokens"] == 16
    assert result["trace"]["arrival_rate_rps"] == pytest.approx(200 / 99.5, abs=1e-3)
