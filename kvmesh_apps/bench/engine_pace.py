"""``kvmesh bench engine``'s two pace figures: what admitting pulled prefixes costs the requests already decoding.

* :func:`pull_vs_recompute`: the same N requests admitted twice while the running requests decode,
  once loading their prefix pulled from the source (``remote_kv_source``), once recomputing it
  (``kvmesh.load`` off); the engine's prefix cache is reset before each run and neither run saves
  the admitted requests' blocks, so each run finds the engine and dp2 as the other did. The window
  is each run's admission: from the first arrival to the last admitted request's first token.
  ``decode_ratio_pull_vs_recompute``: the running requests' tokens/s in the pulled run's window
  over the recomputing run's, per repetition (the order alternates), mean and 95 % interval.
* :func:`during_pulls_isolated`: on an engine pinned to its own CPU (the fleet's processes on the
  others), the running requests' tokens/s while N pulls are in flight (the ``pull_window``) over a
  run without pulls in the same window (``decode_ratio_during_pulls_isolated``), and over a run
  admitting the same N prefixes from the engine's own prefix cache (each with a new suffix, so it
  computes as much as a pulled one: ``decode_ratio_pulled_vs_cached_isolated``, the pull's own cost
  without that of serving the admitted requests), per repetition (the order alternates; the cached
  run follows the pulls that put the prefixes in the cache).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmesh_apps.bench.decode_windows import (Run, admission_window, covered, decode_ratios, interval, pull_window,
                                              report, running_rate)
from kvmesh_apps.engine_host import EngineProcess

QUIET = {"kvmesh": {"load": False, "save": False}}
PULLED = {"save": False}  # the admitted requests keep nothing in dp2: the next run finds it as this one did


def _with(requests: list[dict[str, Any]], params: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**r, "kv_transfer_params": params} for r in requests]


def pull_vs_recompute(dst: EngineProcess, running: list[dict[str, Any]], admitted: list[list[dict[str, Any]]],
                      source: dict[str, Any], reset_prompt: list[int],
                      say: Callable[[str], None]) -> tuple[dict[str, Any], list[tuple[dict, dict, dict]]]:
    """``admitted[r]``: repetition r's N requests (prefixes the source holds, nowhere else). Returns the figures
    and (request, pulled result, recomputed result) of every admitted request, for the output check."""
    modes = {"pulled": {**source, "kvmesh": PULLED}, "recomputed": QUIET}
    ratios: list[float] = []
    rates: dict[str, list[float]] = {"pulled": [], "recomputed": []}
    windows: dict[str, list[float]] = {"pulled": [], "recomputed": []}
    all_covered, peer_tokens, recomputed_cached, pairs = True, 0, 0, []
    for rep, requests in enumerate(admitted):
        ids = [r["id"] for r in requests]
        order = list(modes) if rep % 2 == 0 else list(reversed(modes))
        say(f"pull vs recompute {rep + 1}/{len(admitted)}: {len(requests)} requests admitted {' then '.join(order)}")
        runs: dict[str, Run] = {}
        for mode in order:
            dst.generate(reset_prompt, 1, QUIET, reset_prefix_cache=True)  # nothing of the prompts cached in vLLM
            runs[mode] = dst.concurrent(running + _with(requests, modes[mode]))
            window = admission_window(runs[mode], ids)
            rates[mode].append(running_rate(runs[mode], len(running), window))
            windows[mode].append((window[1] - window[0]) * 1e3)
            all_covered &= covered(runs[mode], len(running), window)
        ratios.append(rates["pulled"][-1] / rates["recomputed"][-1] if rates["recomputed"][-1] else 0.0)
        peer_tokens += sum(report(runs["pulled"][i]).get("peer_tokens", 0) for i in ids)
        recomputed_cached += sum(runs["recomputed"][i].get("num_cached_tokens", 0) for i in ids)
        pairs += [(r, runs["pulled"][r["id"]], runs["recomputed"][r["id"]]) for r in requests]
    return {
        "decode_ratio_pull_vs_recompute": interval(ratios),
        "pull_vs_recompute_decode_tok_s": {mode: interval(v, 1) for mode, v in rates.items()},
        "pull_vs_recompute_window_ms": {mode: interval(v, 1) for mode, v in windows.items()},
        "pull_vs_recompute_peer_tokens": peer_tokens,
        "pull_vs_recompute_recomputed_cached_tokens": recomputed_cached,  # 0: the recomputing runs found nothing
        "pull_vs_recompute_admitted": len(admitted[0]),
        "pull_vs_recompute_windows_covered": all_covered,
    }, pairs


def during_pulls_isolated(dst: EngineProcess, running: list[dict[str, Any]], pullers: list[list[dict[str, Any]]],
                          cached: list[list[dict[str, Any]]], say: Callable[[str], None]) -> dict[str, Any]:
    """``pullers[r]``: repetition r's N pulling requests (fresh prefixes held by the source); ``cached[r]``: the
    same prefixes with other suffixes, no transfer (``kvmesh.load`` off)."""
    vs_none: list[float] = []
    vs_before: list[float] = []
    vs_cached: list[float] = []
    rates: dict[str, list[float]] = {"during_pulls": [], "none": [], "cached": []}
    windows: list[float] = []
    all_covered, peer_tokens, cached_tokens = True, 0, 0
    for rep, requests in enumerate(pullers):
        ids = [r["id"] for r in requests]
        say(f"isolated {rep + 1}/{len(pullers)}: {len(requests)} pulls, none and cached, "
            f"{'pulls first' if rep % 2 == 0 else 'none first'}")
        if rep % 2:
            baseline = dst.concurrent(running)
        pulled = dst.concurrent(running + requests)
        from_cache = dst.concurrent(running + _with(cached[rep], QUIET))
        if not rep % 2:
            baseline = dst.concurrent(running)
        window = pull_window(pulled, ids)
        ratio, before = decode_ratios(pulled, baseline, len(running), window)
        vs_none.append(ratio or 0.0)
        vs_before.append(before or 0.0)
        vs_cached.append(decode_ratios(pulled, from_cache, len(running), window)[0] or 0.0)
        for name, run in (("during_pulls", pulled), ("none", baseline), ("cached", from_cache)):
            rates[name].append(running_rate(run, len(running), window))
            all_covered &= covered(run, len(running), window)
        windows.append((window[1] - window[0]) * 1e3)
        peer_tokens += sum(report(pulled[i]).get("peer_tokens", 0) for i in ids)
        cached_tokens += sum(from_cache[r["id"]].get("num_cached_tokens", 0) for r in cached[rep])
    return {
        "decode_ratio_during_pulls_isolated": interval(vs_none),
        "decode_ratio_during_pulls_isolated_vs_before": interval(vs_before),
        "decode_ratio_pulled_vs_cached_isolated": interval(vs_cached),
        "isolated_decode_tok_s": {k: interval(v, 1) for k, v in rates.items()},
        "isolated_pull_window_ms": interval(windows, 1),
        "isolated_peer_tokens": peer_tokens,
        "isolated_cached_run_cached_tokens": cached_tokens,
        "isolated_windows_covered": all_covered,
    }
