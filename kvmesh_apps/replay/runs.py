"""One replay run (variant x configuration x load x window) in a worker process, and its summary.

A run is a plain, picklable :class:`RunSpec`; :func:`run_many` spreads them over
``jobs`` processes (each run is single-threaded and CPU-bound).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import statistics
from dataclasses import dataclass
from pathlib import Path

from control_plane.routing.config import RoutingSettings
from control_plane.routing.cost_model import break_even_tokens
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.replay.backends import InProcessBackend
from kvmesh_apps.replay.costs import StepCosts
from kvmesh_apps.replay.network import Network
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.sim import Simulation, Totals, variants
from kvmesh_apps.replay.trace import BlockHashes, TraceFormat, TraceRequest, load_window

SLO_ATTAINMENT = 0.9   # the "highest rate meeting the SLO": at least this fraction of TTFTs within it
NEVER = 2**31 - 1      # a threshold no prefix reaches: the threshold rule never pulls
BASELINE = "cost-aware+p2p"   # what the paired differences are taken against


@dataclass(frozen=True)
class RunSpec:
    trace: str
    variant: str
    profile: Profile
    engines: int
    start: int
    requests: int
    time_scale: float
    event_delay_ms: float
    seed: int = 0
    min_cached_token_delta: int | None = None   # the threshold rule's delta (None: the profile's break-even)
    trace_format: TraceFormat = TraceFormat()    # its block size is the profile's block_tokens

    def window(self) -> list[TraceRequest]:
        """The run's requests: its window of the trace, at its time scale."""
        return load_window(Path(self.trace), self.start, self.requests, self.time_scale, self.trace_format)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def arrival_rate(spec: RunSpec) -> float:
    """Requests per second the window arrives at, at its time scale."""
    window = spec.window()
    return len(window) / max(1e-9, window[-1].arrival_ms / 1000.0)


def summarize(t: Totals, ttft_slo_ms: float) -> dict:
    """A request meets the SLO when its TTFT is at most ``ttft_slo_ms`` more than prefilling its prompt alone on
    an idle engine would take (a flat bound would be missed by every long prompt at any load). Goodput: requests
    meeting it per second from the first arrival to the later of the last arrival and the last first token (an
    overloaded fleet stretches the span)."""
    span_s = max(1e-9, (max(t.last_arrival_ms, t.last_first_token_ms) - t.first_arrival_ms) / 1000.0)
    n = len(t.ttft_ms)
    prompt = max(1, t.prompt_tokens)
    met = sum(x <= ttft_slo_ms + alone for x, alone in zip(t.ttft_ms, t.alone_ms))
    return {
        "requests": n,
        "ttft_p50_ms": round(pct(t.ttft_ms, 0.50), 1),
        "ttft_p90_ms": round(pct(t.ttft_ms, 0.90), 1),
        "ttft_p99_ms": round(pct(t.ttft_ms, 0.99), 1),
        "wait_p50_ms": round(pct(t.wait_ms, 0.50), 1),
        "wait_p90_ms": round(pct(t.wait_ms, 0.90), 1),
        "wait_p99_ms": round(pct(t.wait_ms, 0.99), 1),
        "slo_attainment": round(met / n, 4) if n else 0.0,
        "goodput_rps": round(met / span_s, 3),
        "throughput_rps": round(n / span_s, 3),
        "prefill_tokens_saved": t.prompt_tokens - t.computed_tokens - t.slow_pull_tokens,
        "pulls": t.pulls,
        "pulls_slower_than_recompute": t.pulls_slower_than_recompute,
        "pull_timeouts": t.pull_timeouts,
        "bytes_moved": t.bytes_moved,
        "stale_route_rate": round(t.stale_routes / t.routes_with_source, 4) if t.routes_with_source else 0.0,
        "hit_rate_by_tier": {"gpu": round(t.gpu_tokens / prompt, 4), "local_cpu": round(t.local_cpu_tokens / prompt, 4),
                             "peer": round(t.peer_tokens / prompt, 4)},
        "route_ms_p50": round(pct(t.route_ms, 0.50), 3),
    }


def mean_path_bytes_per_s(bandwidths: list[float]) -> float:
    """The bandwidth of the fleet's average pull: a random ordered pair's link (harmonic mean: time per byte)."""
    return len(bandwidths) / sum(1.0 / b for b in bandwidths)


def threshold_tokens(kv_bytes_per_token: int, prefill_tokens_per_s: float, bandwidths: list[float],
                     promotion_bytes_per_s: float, lookup_ms: float) -> int:
    """The threshold rule's ``min_cached_token_delta`` sized for the model and fleet: the break-even of a pull on
    the average link (:func:`break_even_tokens`); :data:`NEVER` where no pull pays on it."""
    tokens = break_even_tokens(kv_bytes_per_token, prefill_tokens_per_s, mean_path_bytes_per_s(bandwidths),
                               promotion_bytes_per_s, lookup_ms)
    return NEVER if tokens is None else tokens


def baseline_settings(profile: Profile, engines: int, costs: StepCosts | None = None) -> RoutingSettings:
    """Routing settings for a replay of ``profile``: the threshold rule's delta at the profile's break-even (the
    prefill rate of an 8,192-token prompt alone, the links of its network), not a figure sized for another model."""
    costs = costs or StepCosts(profile.speed)
    tps = 8192 / (costs.prefill_alone_ms(8192, 0, profile.max_batched_tokens) / 1000.0)
    net = Network(engines, profile.racks, profile.nic_bytes_per_s, profile.inter_rack_bytes_per_s)
    links = [net.path(a, b)[1] for a in range(engines) for b in range(engines) if a != b] or [profile.nic_bytes_per_s]
    return RoutingSettings(route_min_cached_token_delta=threshold_tokens(
        profile.kv_bytes_per_token, tps, links, profile.promotion_bytes_per_s, profile.lookup_ms))


def run_one(spec: RunSpec) -> Totals:
    """One in-process replay (see :mod:`kvmesh_apps.replay.backends`)."""
    variant = next(v for v in variants() if v.name == spec.variant)
    requests = spec.window()
    cache = CacheConfig(block_size=spec.profile.block_tokens)
    ns = Namespace("replay", f"trace-{variant.slug}", "sim", cache).validate()
    settings = baseline_settings(spec.profile, spec.engines)
    if spec.min_cached_token_delta is not None:
        settings = settings.model_copy(update={"route_min_cached_token_delta": spec.min_cached_token_delta})
    backend = InProcessBackend(ns, settings)
    sim = Simulation(variant, requests, BlockHashes(spec.profile.block_tokens), spec.profile, spec.engines, backend,
                     spec.event_delay_ms, seed=spec.seed)
    return asyncio.run(sim.run())


def _summarized(item: tuple[RunSpec, float]) -> dict:
    spec, slo = item
    return summarize(run_one(spec), slo)


def run_many(specs: list[RunSpec], ttft_slo_ms: float, jobs: int) -> list[dict]:
    items = [(s, ttft_slo_ms) for s in specs]
    if jobs <= 1:
        return [_summarized(i) for i in items]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return pool.map(_summarized, items, chunksize=1)


# Student t, two-sided 95 %, by degrees of freedom (1-30); beyond, the normal 1.96
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95 % confidence interval (Student t; None for a single value: no interval)."""
    if len(values) < 2:
        return (values[0] if values else 0.0), None
    t95 = _T95[len(values) - 2] if len(values) - 1 <= len(_T95) else 1.96
    return statistics.fmean(values), t95 * statistics.stdev(values) / math.sqrt(len(values))


def combine(rows: list[dict]) -> dict:
    """Per-window summaries (of distinct windows) -> their means, with ``*_ci95`` half-widths for the headline
    figures (None from a single window)."""
    out: dict = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = {k: round(statistics.fmean(r[key][k] for r in rows), 4) for k in value}
        elif isinstance(value, (int, float)):
            mean, ci = mean_ci([r[key] for r in rows])
            out[key] = round(mean, 3) if isinstance(value, float) else round(mean)
            if key in ("goodput_rps", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "slo_attainment"):
                out[f"{key}_ci95"] = None if ci is None else round(ci, 3)
    out["windows"] = len(rows)
    return out


PAIRED_KEYS = ("goodput_rps", "ttft_p50_ms", "ttft_p90_ms", "slo_attainment")


def paired(rows: list[dict], base: list[dict], keys: tuple[str, ...] = PAIRED_KEYS) -> dict:
    """Per-window differences ``rows[w][key] - base[w][key]`` (the same windows and noise seeds, in order) ->
    ``{"delta_KEY": mean, "delta_KEY_ci95": [lo, hi]}`` (Student t over the windows; None from one window)."""
    if len(rows) != len(base):
        raise ValueError(f"paired rows: {len(rows)} windows against {len(base)}")
    out: dict = {}
    for key in keys:
        mean, half = mean_ci([r[key] - b[key] for r, b in zip(rows, base)])
        out[f"delta_{key}"] = round(mean, 4)
        out[f"delta_{key}_ci95"] = None if half is None else [round(mean - half, 4), round(mean + half, 4)]
    return out


def verdict(delta: float, ci: list[float] | None, higher_is_better: bool) -> str:
    """``wins``/``loses`` for the baseline when the interval excludes 0, else ``tie`` (delta: other - baseline)."""
    if ci is None or ci[0] <= 0 <= ci[1]:
        return "tie"
    return "wins" if (delta < 0) == higher_is_better else "loses"


def max_slo_rate(points: list[tuple[float, float]]) -> float:
    """(arrival rate, SLO attainment) at increasing rates -> the highest rate with attainment >= SLO_ATTAINMENT,
    interpolated between the last rate that meets it and the first that does not (0 when none does)."""
    best = 0.0
    for (r0, a0), (r1, a1) in zip([(0.0, 1.0)] + points, points):
        if a1 >= SLO_ATTAINMENT:
            best = r1
            continue
        if a0 >= SLO_ATTAINMENT:
            best = r0 + (r1 - r0) * (a0 - SLO_ATTAINMENT) / max(1e-9, a0 - a1)
        break
    return round(best, 3)
