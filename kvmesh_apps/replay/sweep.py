"""The default sweep: one parameter at a time around the default point, and the load.

For every configuration (the default, and each swept value) every sweep variant
is replayed at each of ``LOADS`` (trace time scales) to find the highest arrival
rate whose TTFTs still meet the SLO (:func:`~kvmesh_apps.replay.runs.max_slo_rate`);
goodput and TTFT percentiles are reported at the run's ``--time-scale``. Every
variant replays the same windows with the same noise seeds, so every cell also
carries its per-window differences against cost-aware+p2p (mean and 95 %
interval over the windows: :func:`~kvmesh_apps.replay.runs.paired`).
"""

from __future__ import annotations

import dataclasses

from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.runs import BASELINE, RunSpec, arrival_rate, combine, max_slo_rate, paired, run_many

PARAMS: dict[str, list[float]] = {
    "inter_rack_gbytes_per_s": [1.0, 2.5, 5.0, 10.0, 25.0],
    "speed": [0.5, 2.0],                  # step times divided by this: a slower / faster GPU
    "cpu_tier_blocks": [100, 800],
    "event_delay_ms": [0.0, 1000.0, 5000.0],
}
LOADS = [0.5, 1.0, 1.5, 2.0]
LOAD_CURVE = [0.5, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5]
VARIANTS = ["cost-aware+p2p", "cost-aware-nop2p", "token-aware+p2p", "token-aware-nop2p", "load-aware+p2p",
            "affinity+p2p"]


def _configure(base: RunSpec, param: str | None, value: float) -> RunSpec:
    if param is None:
        return base
    if param == "event_delay_ms":
        return dataclasses.replace(base, event_delay_ms=value)
    if param == "inter_rack_gbytes_per_s":
        return dataclasses.replace(base, profile=dataclasses.replace(base.profile, inter_rack_bytes_per_s=value * 1e9))
    cast = int if isinstance(getattr(Profile(), param), int) else float
    return dataclasses.replace(base, profile=dataclasses.replace(base.profile, **{param: cast(value)}))


def sweep(base: RunSpec, names: list[str], windows: list[int], ttft_slo_ms: float, jobs: int,
          params: dict[str, list[float]] = PARAMS, load_curve: list[float] = LOAD_CURVE,
          loads: list[float] = LOADS) -> list[dict]:
    """``base``: the default point (its ``time_scale`` is where goodput is read); one run per
    (configuration, load, variant, window)."""
    configs: list[tuple[str | None, float]] = [(None, 0.0)] + [(p, v) for p, vs in params.items() for v in vs]
    plan: list[tuple[tuple, RunSpec]] = []
    for param, value in configs:
        at_loads = sorted(set((load_curve if param is None else loads) + [base.time_scale]))
        for load in at_loads:
            for name in names:
                for w, start in enumerate(windows):
                    spec = dataclasses.replace(_configure(base, param, value), variant=name, time_scale=load,
                                               start=start, seed=w)
                    plan.append(((param, value, load, name), spec))
    rows = run_many([spec for _, spec in plan], ttft_slo_ms, jobs)
    grouped: dict[tuple, list[dict]] = {}
    for (key, _), row in zip(plan, rows):
        grouped.setdefault(key, []).append(row)
    rate1 = sum(arrival_rate(dataclasses.replace(base, start=s, time_scale=1.0)) for s in windows) / len(windows)

    def at(param, value, load, name) -> dict:
        return combine(grouped[(param, value, load, name)])

    def headline(param, value, load, name) -> dict:
        r = at(param, value, load, name)
        xs = sorted({k[2] for k in grouped if k[0] == param and k[1] == value})
        rate = max_slo_rate([(rate1 * x, at(param, value, x, name)["slo_attainment"]) for x in xs])
        out = {"goodput_rps": r["goodput_rps"], "goodput_rps_ci95": r["goodput_rps_ci95"], "max_slo_rate_rps": rate,
               "ttft_p50_ms": r["ttft_p50_ms"], "ttft_p90_ms": r["ttft_p90_ms"], "ttft_p99_ms": r["ttft_p99_ms"],
               "wait_p90_ms": r["wait_p90_ms"], "slo_attainment": r["slo_attainment"],
               "slo_attainment_ci95": r["slo_attainment_ci95"], "windows": r["windows"]}
        if BASELINE in names and name != BASELINE:
            out["vs_cost_aware"] = paired(grouped[(param, value, load, name)], grouped[(param, value, load, BASELINE)])
        return out

    out = []
    for load in sorted({k[2] for k in grouped if k[0] is None}):
        out.append({"point": {"time_scale": load, "arrival_rate_rps": round(rate1 * load, 3)},
                    "policies": {n: headline(None, 0.0, load, n) for n in names}})
    for param, value in configs[1:]:
        out.append({"point": {param: value}, "policies": {n: headline(param, value, base.time_scale, n)
                                                          for n in names}})
    return out


def winners(points: list[dict]) -> list[dict]:
    """Per point: the variant with the best goodput and the one with the highest SLO-meeting rate."""
    out = []
    for p in points:
        pol = p["policies"]
        out.append({"point": p["point"],
                    "best_goodput": max(pol, key=lambda n: pol[n]["goodput_rps"]),
                    "best_max_slo_rate": max(pol, key=lambda n: pol[n]["max_slo_rate_rps"])})
    return out
