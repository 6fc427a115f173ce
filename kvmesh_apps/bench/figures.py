"""What the engine benches share (``bench engine``, ``bench routing``, ``bench prefetch``): 95 % intervals on
per-repetition figures, the connector's per-request report, and the ending of a bench that prints progress and
then its figures (with ``--json``: progress on stderr, the last line one JSON object)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

from kvmesh_apps.replay.runs import mean_ci


def interval(values: list[float], digits: int = 1) -> tuple[float, list[float] | None]:
    """The mean of ``values`` and its 95 % interval (Student t; None from a single value)."""
    mean, half = mean_ci(values)
    return round(mean, digits), None if half is None else [round(mean - half, digits), round(mean + half, digits)]


def interval_record(values: list[float], digits: int = 1) -> dict[str, Any]:
    """``{"mean", "ci95", "per_repetition"}`` of per-repetition ``values``."""
    mean, ci95 = interval(values, digits)
    return {"mean": mean, "ci95": ci95, "per_repetition": [round(v, digits) for v in values]}


def load_report(reply: dict[str, Any]) -> dict[str, Any]:
    """The connector's account of a request's loads (``kv_transfer_params["kvmesh"]``)."""
    return (reply.get("kv_transfer_params") or {}).get("kvmesh") or {}


def progress(as_json: bool) -> Callable[[str], None]:
    """Prints a line of progress: on stderr under ``--json`` (stdout ends with the JSON object), else stdout."""
    out = sys.stderr if as_json else sys.stdout
    return lambda text: print(text, file=out, flush=True)


def finish(result: dict[str, Any], started: float, as_json: bool, say: Callable[[str], None], width: int = 34) -> None:
    """Adds ``wall_s`` (since ``started``, a ``time.perf_counter()``) and prints ``result``: one JSON line, or one
    ``key value`` line per figure."""
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if as_json:
        print(json.dumps(result), flush=True)
        return
    for key, value in result.items():
        say(f"  {key:<{width}} {value}")
