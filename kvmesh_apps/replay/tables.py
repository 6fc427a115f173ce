"""``python -m kvmesh_apps.replay.tables REPLAY_JSON``: docs/scheduling.md's replay tables from a ``replay.json``.

Prints two Markdown tables: the default point (every variant: goodput with its own interval, SLO attainment,
TTFT percentiles, and the paired per-window differences against cost-aware+p2p with their 95 % intervals) and
the sweep (per point and variant: goodput ± its interval / highest SLO-meeting rate, and the paired goodput
difference against cost-aware+p2p [lo, hi]).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvmesh_apps.replay.runs import BASELINE, verdict
from kvmesh.command_line import Parser, UsageError, run_command


def _interval(ci: list[float] | None, digits: int) -> str:
    return "n/a" if ci is None else f"[{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"


def _paired(p: dict, key: str, digits: int, higher_is_better: bool) -> str:
    d = p.get("vs_cost_aware")
    if d is None:
        return "—"
    delta, ci = d[f"delta_{key}"], d[f"delta_{key}_ci95"]
    mark = {"tie": "", "wins": " (c-a wins)", "loses": " (c-a loses)"}[verdict(delta, ci, higher_is_better)]
    return f"{delta:+.{digits}f} {_interval(ci, digits)}{mark}"


def default_point(result: dict) -> str:
    rows = ["| variant | goodput req/s (±95%) | SLO met | TTFT p50 ms | p90 ms | p99 ms | Δ goodput vs cost-aware+p2p "
            "[95 %] | Δ p50 ms [95 %] | Δ p90 ms [95 %] | pulls | slow pulls | pull timeouts |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in result["policies"].items():
        ci = p.get("goodput_rps_ci95")
        rows.append(f"| {name} | {p['goodput_rps']:.2f} ± {ci if ci is not None else 'n/a'} | "
                    f"{100 * p['slo_attainment']:.1f} % | {p['ttft_p50_ms']:.0f} | {p['ttft_p90_ms']:.0f} | "
                    f"{p['ttft_p99_ms']:.0f} | {_paired(p, 'goodput_rps', 3, True)} | "
                    f"{_paired(p, 'ttft_p50_ms', 0, False)} | {_paired(p, 'ttft_p90_ms', 0, False)} | "
                    f"{p['pulls']} | {p['pulls_slower_than_recompute']} | {p.get('pull_timeouts', 0)} |")
    return "\n".join(rows)


def sweep(result: dict) -> str:
    points = result.get("sweep", [])
    if not points:
        return ""
    names = list(points[0]["policies"])
    rows = ["| point | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for point in points:
        where = ", ".join(f"{k}={v}" for k, v in point["point"].items())
        cells = []
        for name in names:
            p = point["policies"][name]
            ci = p.get("goodput_rps_ci95")
            cell = f"{p['goodput_rps']:.2f}±{ci if ci is not None else 'n/a'} / {p['max_slo_rate_rps']:.2f}"
            if name != BASELINE and "vs_cost_aware" in p:
                cell += f"; Δ {_paired(p, 'goodput_rps', 3, True)}"
            cells.append(cell)
        rows.append(f"| {where} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    parser = Parser(prog="python -m kvmesh_apps.replay.tables",
                    description="Prints docs/scheduling.md's replay tables (Markdown) from a replay.json.")
    parser.add_argument("replay_json", help="a replay.json that `kvmesh bench replay` wrote")
    path = Path(parser.parse_args(argv).replay_json)
    try:
        result = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError:
        raise UsageError(f"{path}: not JSON: give the replay.json `kvmesh bench replay` wrote") from None
    if not isinstance(result, dict) or "policies" not in result:
        raise UsageError(f"{path}: not a replay.json from `kvmesh bench replay` (it has no 'policies')")
    print(default_point(result))
    print()
    print(sweep(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m kvmesh_apps.replay.tables", main, sys.argv[1:]))  # one line for any error, as `kvmesh` gives
