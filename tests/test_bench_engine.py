"""kvmesh bench engine's window arithmetic on synthetic token times (the benchmark itself needs engines)."""

from __future__ import annotations

import pytest

from kvmesh_apps.bench.decode_windows import (admission_window, covered, decode_ratios, interval, pull_window,
                                              running_rate)


def _running(step_s: float, until: float, stall: tuple[float, float] = (0.0, 0.0)) -> dict:
    """Two running requests that each get a token every ``step_s`` except inside ``stall``."""
    times = [round(i * step_s, 6) for i in range(int(until / step_s))]
    times = [t for t in times if not stall[0] <= t < stall[1]]
    return {f"run-{i}": {"token_times": times} for i in range(2)}


def test_the_window_spans_arrival_to_the_last_answer() -> None:
    results = {"a": {"added_s": 3.0, "kv_transfer_params": {"kvmesh": {"wait_ms": 100.0}}},
               "b": {"added_s": 3.1, "kv_transfer_params": {"kvmesh": {"wait_ms": 400.0}}}}
    assert pull_window(results, ["a", "b"]) == (3.0, 3.5)


def test_undisturbed_decoding_gives_one_and_a_stall_shows() -> None:
    baseline = _running(0.01, 10.0)
    assert decode_ratios(_running(0.01, 10.0), baseline, 2, (3.0, 4.0)) == (1.0, 1.0)
    ratio, before = decode_ratios(_running(0.01, 10.0, stall=(3.0, 3.5)), baseline, 2, (3.0, 4.0))
    assert ratio == pytest.approx(0.5, abs=0.02) and before == pytest.approx(0.5, abs=0.02)


def test_no_baseline_tokens_in_the_window_gives_none() -> None:
    assert decode_ratios(_running(0.01, 10.0), _running(0.01, 1.0), 2, (3.0, 4.0))[0] is None


def test_the_admission_window_ends_at_the_last_first_token() -> None:
    results = {"a": {"added_s": 3.0, "token_times": [3.4, 3.5]}, "b": {"added_s": 3.1, "token_times": [3.9]}}
    assert admission_window(results, ["a", "b"]) == (3.0, 3.9)


def test_running_rate_and_coverage() -> None:
    run = _running(0.01, 10.0)
    assert running_rate(run, 2, (3.0, 4.0)) == pytest.approx(200, abs=4)  # two requests, 100 tokens/s each
    assert covered(run, 2, (3.0, 4.0)) and not covered(_running(0.01, 3.5), 2, (3.0, 4.0))


def test_the_interval_of_paired_repetitions() -> None:
    assert interval([1.0])["ci95"] is None
    spread = interval([1.0, 2.0, 3.0])
    assert spread["mean"] == 2.0 and spread["ci95"][0] < 2.0 < spread["ci95"][1]
    assert spread["per_repetition"] == [1.0, 2.0, 3.0]
