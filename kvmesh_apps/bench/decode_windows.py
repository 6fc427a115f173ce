"""Window arithmetic of ``kvmesh bench engine``: the running requests' decode rate in a window of a run.

A run is the engine host's ``concurrent`` answer: per request id, ``added_s`` and ``token_times``
(seconds from the run's start) and the connector's report in ``kv_transfer_params["kvmesh"]``.
The running requests are ``run-0`` .. ``run-{n-1}``.
"""

from __future__ import annotations

from typing import Any

from kvmesh_apps.bench.figures import interval_record, load_report as report  # noqa: F401 - report: used as ours

Run = dict[str, dict[str, Any]]



def _rate(times: list[float], start: float, end: float) -> float:
    """Tokens per second arriving in [start, end]."""
    if end <= start:
        return 0.0
    return sum(start <= t <= end for t in times) / (end - start)


def _ratio(during: float, baseline: float) -> float | None:
    """during / baseline; None when the baseline produced nothing in the window (running requests ended first)."""
    return round(during / baseline, 3) if baseline else None


def _running_times(results: Run, running: int) -> list[float]:
    return [t for i in range(running) for t in results[f"run-{i}"]["token_times"]]


def running_rate(results: Run, running: int, window: tuple[float, float]) -> float:
    """The running requests' tokens per second in ``window`` (all of them together)."""
    return _rate(_running_times(results, running), *window)


def covered(results: Run, running: int, window: tuple[float, float]) -> bool:
    """Whether every running request was still decoding at the window's end (else its rate there is no rate)."""
    return all(results[f"run-{i}"]["token_times"][-1] >= window[1] for i in range(running))


def pull_window(results: Run, ids: list[str]) -> tuple[float, float]:
    """[first arrival, last answer] of requests ``ids``: while their lookups and pulls were in flight (the
    connector's ``wait_ms`` from the first ask; the copies and the prefill of the suffix come after)."""
    start = min(results[i]["added_s"] for i in ids)
    end = max(results[i]["added_s"] + report(results[i]).get("wait_ms", 0.0) / 1e3 for i in ids)
    return start, end


def admission_window(results: Run, ids: list[str]) -> tuple[float, float]:
    """[first arrival, last first token] of requests ``ids``: until every one has its prompt in the cache
    (pulled and copied, or recomputed) and has produced its first token."""
    return min(results[i]["added_s"] for i in ids), max(results[i]["token_times"][0] for i in ids)


def decode_ratios(run: Run, baseline: Run, running: int,
                  window: tuple[float, float]) -> tuple[float | None, float | None]:
    """The running requests' decode rate in ``window`` of ``run`` over (the same window of ``baseline``, the
    window of equal length just before it in ``run``)."""
    start, end = window
    during = running_rate(run, running, window)
    return (_ratio(during, running_rate(baseline, running, window)),
            _ratio(during, running_rate(run, running, (2 * start - end, start))))


def interval(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Mean of per-repetition values with its 95 % confidence interval (Student t; None from one value)."""
    return interval_record(values, digits)
