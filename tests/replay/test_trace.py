"""Trace input of `kvmesh bench replay` and `kvmesh bench sim-to-real`: every row checked, a bad one named by file,
line and field; windows never duplicated; bad input exits 2 with one line, before anything runs."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.command_line import run_command
from kvmesh_apps.bench import sim_to_real
from kvmesh_apps.replay import bench
from kvmesh_apps.replay.trace import TraceError, TraceInfo, load_window, parse_row, scan, select_windows

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
BAD_ROWS = [   # (the line, what the message must name)
    ("not json", "not JSON"),
    ("[1, 2]", "a JSON array, not one JSON object per line (JSONL): convert it with jq -c '.[]'"),
    ('"row"', "not a JSON object (got str)"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "output_length"}), "output_length: missing"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "timestamp"}), "timestamp: missing"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "hash_ids: missing"),
    (json.dumps({**GOOD, "timestamp": "x"}), "timestamp: must be a number"),
    (json.dumps({**GOOD, "timestamp": True}), "timestamp: must be a number"),
    (json.dumps({**GOOD, "timestamp": -5}), "timestamp: must be a finite number >= 0"),
    ('{"timestamp": NaN, "input_length": 600, "output_length": 5, "hash_ids": []}', "timestamp: must be a finite"),
    (json.dumps({**GOOD, "input_length": "600"}), "input_length: must be an integer"),
    (json.dumps({**GOOD, "input_length": 600.5}), "input_length: must be an integer"),
    (json.dumps({**GOOD, "input_length": -1}), "input_length: must be >= 1"),
    (json.dumps({**GOOD, "input_length": 0, "hash_ids": []}), "input_length: must be >= 1"),
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
     "timestamp: too large"),
    # one id per 16 tokens (a trace cut in smaller blocks): replayed as 512-token blocks, its hit rates were wrong
    (json.dumps({**GOOD, "hash_ids": list(range(38))}), "hash_ids: 38 ids for input_length 600, not one per 512-token "
     "block (that is 1 or 2): its ids imply 16-token blocks; replay with --trace-block-tokens 16"),
    (json.dumps({**GOOD, "input_length": 2048}), "hash_ids: 2 ids for input_length 2048"),
    (json.dumps({**GOOD, "output_length": None}), "output_length: must be an integer"),
    (json.dumps({**GOOD, "output_length": -3}), "output_length: must be >= 0"),
    (json.dumps({**GOOD, "hash_ids": "1,2"}), "hash_ids: must be a list"),
    (json.dumps({**GOOD, "hash_ids": [1, "2"]}), "hash_ids[1]: must be an integer"),
    (json.dumps({**GOOD, "hash_ids": [1, -2]}), "hash_ids[1]: must be an integer in [0, 2**64)"),
    (json.dumps({**GOOD, "hash_ids": [2**64]}), "hash_ids[0]: must be an integer in [0, 2**64)"),
]
TINY = ["--engines", "4", "--jobs", "1", "--variants", "cost-aware+p2p,no-sharing", "--no-sweep"]


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def trace_of(path: Path, n: int) -> Path:
    """``n`` rows, 1 s apart, sharing a first block (so the replay has prefixes to reuse)."""
    return write(path, [{"timestamp": 1000 * i, "input_length": 2048, "output_length": 20, "hash_ids": [0, i, i + 1, 7]}
                        for i in range(n)])


def one_line_error(main, argv: list[str], capsys, prog: str = "kvmesh bench replay") -> str:
    assert run_command(prog, main, argv) == 2   # as `kvmesh bench ...` runs it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: ") and "Traceback" not in err, err
    return err


def test_a_good_row_parses_and_every_bad_one_names_its_field():
    assert parse_row(json.dumps(GOOD)).hash_ids == (1, 2)   # positive control
    assert parse_row(json.dumps({**GOOD, "timestamp": 12.5, "extra": 1})).arrival_ms == 12.5
    for line, reason in BAD_ROWS:
        with pytest.raises(ValueError) as caught:
            parse_row(line)
        assert reason in str(caught.value), line


@pytest.mark.parametrize("line, reason", BAD_ROWS)
def test_a_malformed_line_exits_2_naming_file_line_and_field(tmp_path, capsys, line, reason):
    trace = write(tmp_path / "t.jsonl", [GOOD, "", line, GOOD])   # blank line 2: skipped, still counted as a line
    err = one_line_error(bench.main, ["--trace", str(trace), *TINY, "--out", str(tmp_path / "o")], capsys)
    assert f"{trace}, line 3: {reason}" in err


def test_bad_files_and_arguments_exit_2_with_one_line(tmp_path, capsys):
    trace = trace_of(tmp_path / "t.jsonl", 30)
    (tmp_path / "bin").write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    cases = [
        (["--trace", str(tmp_path / "missing.jsonl")], "cannot read the trace (No such file or directory)"),
        (["--trace", str(tmp_path)], "cannot read the trace"),
        (["--trace", str(tmp_path / "bin")], "line 2: not UTF-8 text"),
        (["--trace", str(write(tmp_path / "empty.jsonl", ["", "  "]))], "no requests"),
        (["--trace", str(trace), "--start", "30"], f"--start 30 is past the end of {trace}: it has 30 requests"),
        (["--trace", str(trace), "--start", "-1"], "argument --start: must be an integer >= 0"),
        (["--trace", str(trace), "--requests", "0"], "argument --requests: must be a positive integer"),
        (["--trace", str(trace), "--windows", "-2"], "argument --windows: must be a positive integer"),
        (["--trace", str(trace), "--time-scale", "0"], "argument --time-scale: must be a positive number"),
        (["--trace", str(trace), "--time-scale", "nan"], "argument --time-scale: must be a positive number"),
        (["--trace", str(trace), "--engines", "0"], "argument --engines: must be a positive integer"),
        (["--trace", str(trace), "--sweep-windows", "0"], "argument --sweep-windows: must be a positive integer"),
        (["--trace", str(trace), "--variants", "best"], "argument --variants: unknown 'best'"),
        (["--trace", str(trace), "--sweep-loads", "1,x"], "argument --sweep-loads: must be a positive number"),
        (["--trace", str(trace), "--out", str(trace)], f"--out {trace}:"),
        ([], "the following arguments are required: --trace"),
        (["--trace", str(trace), "--sweep-requests", "1"], "requests 0 to 0 all arrive at one time"),
    ]
    for argv, reason in cases:
        assert reason in one_line_error(bench.main, argv, capsys), argv


def test_the_command_line_gives_no_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "bench", "replay", "--trace",
                          str(tmp_path / "missing.jsonl")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("kvmesh bench replay: ") and out.stderr.count("\n") == 1, out.stderr


def test_blank_lines_are_skipped_and_a_window_is_replayed_in_arrival_order(tmp_path):
    rows = [{**GOOD, "timestamp": t, "hash_ids": [t]} for t in (5000, 3000, 4000, 3000, 9000)]
    trace = write(tmp_path / "t.jsonl", ["", rows[0], rows[1], "", rows[2], rows[3], rows[4], ""])
    assert scan(trace) == TraceInfo(trace, requests=5, lines=7, largest_tokens=605, largest_line=2)
    window = load_window(trace, start=0, count=4, time_scale=2.0)
    assert [r.arrival_ms for r in window] == [0, 0, 500, 1000]      # sorted, shifted to the earliest, scaled
    assert [r.hash_ids for r in window] == [(3000,), (3000,), (4000,), (5000,)]   # ties keep file order
    with pytest.raises(TraceError, match="does not fit: the trace has 5 requests"):
        load_window(trace, start=3, count=3)


def test_windows_are_disjoint_for_every_trace_length():
    """Regression: the starts were clamped to ``lines - requests``, so a short trace replayed one window several
    times ([0, 1000, 1000] on 5,000 lines) and its confidence interval counted the copies as independent."""
    for n, start, windows, requests in itertools.product((1, 7, 50, 5000, 12031), (0, 3, 4990), (1, 2, 3, 5),
                                                         (1, 4, 1000, 4000)):
        if start >= n:
            with pytest.raises(TraceError, match=f"has {n} requests"):
                select_windows(TraceInfo(Path("t"), n, n), start, windows, requests)
            continue
        plan = select_windows(TraceInfo(Path("t"), n, n), start, windows, requests)
        s = plan.starts
        assert s[0] == start and plan.requests == min(requests, n - start) and 1 <= len(s) <= windows
        assert all(b - a >= plan.requests for a, b in zip(s, s[1:]))             # disjoint, hence distinct
        assert s[-1] + plan.requests <= n                                          # inside the trace
        fits = 1 + (n - start - plan.requests) // plan.requests                   # adjacent windows that fit
        assert len(s) == min(windows, fits)                                        # none dropped that fits
        assert bool(plan.note) == (len(s) < windows or plan.requests < requests)
    plan = select_windows(TraceInfo(Path("t"), 12031, 12031), 0, 3, 4000)
    assert plan.starts == (0, 4000, 8000) and not plan.note                      # the long trace: as before
    assert select_windows(TraceInfo(Path("t"), 5000, 5000), 0, 3, 1000).starts == (0, 2000, 4000)


def test_a_valid_short_trace_runs_on_the_windows_that_fit_and_says_so(tmp_path, capsys):
    trace = trace_of(tmp_path / "t.jsonl", 120)
    assert bench.main(["--trace", str(trace), *TINY, "--requests", "50", "--windows", "3", "--out",
                       str(tmp_path / "o"), "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    result = json.loads(out[-1])
    assert result["trace"]["windows"] == [0, 50] and result["trace"]["windows_requested"] == 3
    assert result["trace"]["requests"] == 50 and result["trace"]["trace_requests"] == 120
    assert "2 disjoint windows, not 3" in result["trace"]["note"]
    assert f"note: {result['trace']['note']}" in out
    for r in result["policies"].values():
        assert r["windows"] == 2 and r["requests"] == 50 and r["goodput_rps_ci95"] is not None


def test_one_window_has_no_confidence_interval_and_the_sweep_gets_distinct_windows(tmp_path, capsys):
    trace = trace_of(tmp_path / "t.jsonl", 60)
    argv = ["--trace", str(trace), "--engines", "4", "--jobs", "1", "--variants", "cost-aware+p2p",
            "--requests", "100", "--windows", "3", "--sweep-requests", "20", "--sweep-windows", "5",
            "--sweep-variants", "cost-aware+p2p", "--sweep-params", "speed", "--sweep-loads", "1",
            "--out", str(tmp_path / "o"), "--json"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    result = json.loads(out[-1])
    assert result["trace"]["windows"] == [0] and result["trace"]["requests"] == 60
    assert "windows of 60 requests, not 100" in result["trace"]["note"] and "no confidence interval" in out[1]
    assert out[2] == "note: sweep: 3 disjoint windows, not 5: the trace has 60 requests from request 0 on"
    policy = result["policies"]["cost-aware+p2p"]
    assert policy["windows"] == 1 and policy["goodput_rps_ci95"] is None
    assert " n/a " in next(line for line in out if line.startswith("cost-aware+p2p"))
    assert result["trace"]["sweep"]["windows"] == [0, 20, 40] and result["trace"]["sweep"]["windows_requested"] == 5
    assert all(p["policies"]["cost-aware+p2p"]["goodput_rps_ci95"] is not None for p in result["sweep"])


class Started(Exception):
    """sim-to-real got past its input checks (it went on to build the model)."""


def stop_before_engines(monkeypatch) -> None:
    """sim-to-real raises :class:`Started` where it would start building engines."""
    def build_tiny_llama(*_):
        raise Started
    monkeypatch.setattr(sim_to_real, "build_tiny_llama", build_tiny_llama)


def test_sim_to_real_checks_its_input_before_starting_anything(tmp_path, capsys, monkeypatch):
    stop_before_engines(monkeypatch)
    trace = trace_of(tmp_path / "t.jsonl", 10)
    bad = write(tmp_path / "bad.jsonl", [GOOD, {**GOOD, "hash_ids": [1, -2]}])
    prog = "kvmesh bench sim-to-real"
    for argv, reason in [
        (["--trace", str(bad)], f"{bad}, line 2: hash_ids[1]"),
        (["--trace", str(tmp_path / "missing.jsonl")], "cannot read the trace"),
        (["--trace", str(trace), "--start", "10"], "--start 10 is past the end"),
        (["--trace", str(trace), "--requests", "0"], "argument --requests: must be a positive integer"),
        (["--trace", str(trace), "--load", "-1"], "argument --load: must be a positive number"),
        (["--trace", str(trace), "--policies", "fastest"], "argument --policies: unknown 'fastest'"),
    ]:
        assert reason in one_line_error(sim_to_real.main, argv, capsys, prog), argv
    with pytest.raises(Started):   # positive control: valid input goes on to build the model
        sim_to_real.main(["--trace", str(trace), "--requests", "36"])


def test_an_interval_needs_two_windows_and_widens_with_fewer():
    from kvmesh_apps.replay.runs import mean_ci

    assert mean_ci([3.0]) == (3.0, None)
    _, two = mean_ci([1.0, 3.0])
    assert two == pytest.approx(12.706)      # Student t, 1 degree of freedom: stdev sqrt(2) over sqrt(2) values
    _, nine = mean_ci([1.0, 3.0] * 4 + [2.0])
    _, forty = mean_ci([1.0, 3.0] * 20)
    sd9, sd40 = (sum((x - 2.0) ** 2 for x in [1.0, 3.0] * 4) / 8) ** 0.5, (40 / 39) ** 0.5
    assert nine == pytest.approx(2.306 * sd9 / 3) and forty == pytest.approx(1.96 * sd40 / 40 ** 0.5)


def test_a_gzipped_trace_and_one_with_a_byte_order_mark_read_as_the_plain_one(tmp_path):
    import gzip

    plain = trace_of(tmp_path / "t.jsonl", 30)
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    windows = [load_window(p, 3, 20) for p in (plain, packed, marked)]
    assert windows[0] == windows[1] == windows[2] and len(windows[0]) == 20
    assert scan(packed).requests == scan(marked).requests == 30
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-12])  # a truncated download
    with pytest.raises(TraceError, match="cannot read the trace"):
        scan(cut)


def test_a_request_no_engine_can_hold_and_a_window_over_a_day_exit_2_before_any_run(tmp_path, capsys):
    """Found in review: a request needing more KV blocks than an engine has was never admitted, and blocked its
    engine's queue: the requests behind it vanished from the figures (181 of 200 reported, no word said); a row
    in epoch milliseconds among relative times made the replay tick every 250 ms across 55 years (killed at
    60 s, memory growing). Both are refused in one line, naming the line or the window; control: the same
    trace fits an engine with enough blocks."""
    trace = trace_of(tmp_path / "t.jsonl", 30)   # 2,048 + 20 tokens a request: 5 blocks of 512
    err = one_line_error(bench.main, ["--trace", str(trace), *TINY, "--gpu-kv-blocks", "4", "--out",
                                      str(tmp_path / "o")], capsys)
    assert (f"{trace}, line 1: a request of 2068 tokens (prompt and output) needs 5 KV blocks of 512 tokens, more "
            "than an engine holds (--gpu-kv-blocks 4)") in err
    scan(trace).check_fits(5, 512, "--gpu-kv-blocks")   # control: 5 blocks hold it
    rows = [{"timestamp": 1000 * i, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]} for i in range(30)]
    rows[7]["timestamp"] = 1_733_300_000_000
    late = write(tmp_path / "late.jsonl", rows)
    err = one_line_error(bench.main, ["--trace", str(late), *TINY, "--requests", "10", "--windows", "1", "--out",
                                      str(tmp_path / "o")], capsys)
    assert "requests 0 to 9 arrive over 4.81e+05 hours" in err and "more than a day" in err
    assert len(load_window(late, 10, 20)) == 20   # control: the windows without that row


def test_the_tables_tool_takes_help_and_refuses_what_is_not_a_replay_json_in_one_line(tmp_path, capsys):
    """Found in review: `--help` was read as a file name, and a JSON file that is not a replay result gave a
    KeyError. Control: --help exits 0 naming the argument."""
    from kvmesh_apps.replay import tables

    prog = "python -m kvmesh_apps.replay.tables"
    with pytest.raises(SystemExit) as helped:
        tables.main(["--help"])
    assert helped.value.code == 0 and "replay_json" in capsys.readouterr().out
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "text").write_text("not json")
    for argv, reason in (([str(tmp_path / "empty.json")], "not a replay.json from `kvmesh bench replay`"),
                         ([str(tmp_path / "text")], "not JSON"), ([str(tmp_path / "missing")], "cannot read it"),
                         ([], "the following arguments are required: replay_json")):
        assert reason in one_line_error(tables.main, argv, capsys, prog), argv
