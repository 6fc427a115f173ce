"""``kvmesh bench replay --trace PATH [--engines 8] [--json] [--no-sweep]``: policies compared on a real trace.

The default point: every variant on ``--windows`` disjoint windows of ``--requests``
requests (means with 95 % confidence intervals; fewer or shorter windows, said in
the report and in ``trace``, when the trace cannot hold them), routed by the control plane's
router in process (``--control-plane real`` adds the same replay of the first
window through a real control-plane process and Redis). Then the sweep
(:mod:`kvmesh_apps.replay.sweep`) on ``--sweep-requests``-request windows.
Writes ``replay.json`` and ``replay.png`` to ``--out``; the last line printed is
the JSON: ``{"policies", "profile", "trace", "sweep", ...}``. Bad input (the trace
checked line by line first) exits 2 with one line on stderr. A trace in other units than
Mooncake's (``--trace-block-tokens``, ``--trace-time-unit``): :class:`~kvmesh_apps.replay.trace.TraceFormat`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from control_plane.scheduler_client import SchedulerClient
from kvmesh.command_line import Parser, UsageError, non_negative_float, non_negative_int, positive_float, \
    positive_int, subset
from kvmesh.grpc_server import channel_options
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import control_plane_pb2_grpc as pb_grpc, tenant_admin_pb2, tenant_admin_pb2_grpc
from kvmesh_apps.procs import ServiceProcess
from kvmesh_apps.redis_server import RedisServer
from kvmesh_apps.replay.backends import ControlPlaneBackend
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.runs import BASELINE, RunSpec, baseline_settings, combine, paired, run_many, summarize
from kvmesh_apps.replay.sim import Simulation, variants
from kvmesh_apps.replay.sweep import LOAD_CURVE, PARAMS, VARIANTS, sweep, winners
from kvmesh_apps.replay.trace import BlockHashes, TraceError, TraceFormat, add_format_arguments, check_arrivals, \
    format_of, load_window, scan, select_windows
from tenancy.api_keys import new_key


async def _through_control_plane(base: RunSpec, names: list[str], cp_address: str, key: str) -> dict:
    requests = base.window()
    metadata = (("authorization", f"Bearer {key}"),)
    run_id = uuid.uuid4().hex[:8]
    async with grpc.aio.insecure_channel(cp_address, options=channel_options()) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)
        await tenant_admin_pb2_grpc.TenantAdminStub(channel).CreateTenant(
            tenant_admin_pb2.CreateTenantRequest(tenant_id="replay"), metadata=metadata)
        sims = []
        for v in variants():
            if v.name not in names:
                continue
            cache = CacheConfig(block_size=base.profile.block_tokens)
            ns = Namespace("replay", f"trace-{v.slug}", run_id, cache).validate()
            backend = ControlPlaneBackend(SchedulerClient(cp_address, ns, api_key=key, timeout_s=30.0), stub,
                                          metadata)
            sims.append((v.name, Simulation(v, requests, BlockHashes(base.profile.block_tokens), base.profile,
                                            base.engines, backend, base.event_delay_ms)))
        try:
            results = await asyncio.gather(*(s.run() for _, s in sims))
        finally:
            for _, s in sims:
                await s.backend.close()
    return dict(zip([n for n, _ in sims], results))


def control_plane_check(base: RunSpec, names: list[str], ttft_slo_ms: float, speculative_ttl_ms: int) -> dict:
    """The first window through a real control plane (its clock is the wall clock: see docs/scheduling.md)."""
    _, key, _ = new_key()
    with tempfile.TemporaryDirectory(prefix="kvmesh-replay-") as tmp:
        redis = RedisServer(Path(tmp) / "redis").start()
        cp = ServiceProcess(["control-plane", "--listen", "127.0.0.1:0", "--redis-url", redis.url,
                             "--lease-ms", "86400000", "--key-prefix", "replay"],
                            env={"KVMESH_CP_ADMIN_KEY": key,
                                 "KVMESH_CP_ROUTE_SPECULATIVE_TTL_MS": str(speculative_ttl_ms),
                                 "KVMESH_CP_ROUTE_MIN_CACHED_TOKEN_DELTA": str(baseline_settings(
                                     base.profile, base.engines).route_min_cached_token_delta)},
                            log_path=Path(tmp) / "cp.log")
        try:
            cp.start()
            totals = asyncio.run(_through_control_plane(base, names, cp.address, key))
        finally:
            cp.stop()
            redis.stop()
    return {n: summarize(t, ttft_slo_ms) for n, t in totals.items()}


PROG = "kvmesh bench replay"


def _parser() -> Parser:
    d = Profile()
    all_names = [v.name for v in variants()]
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    add_format_arguments(parser)
    parser.add_argument("--engines", type=positive_int, default=8)
    parser.add_argument("--start", type=non_negative_int, default=0,
                        help="first request of the first window (from 0; blank lines do not count)")
    parser.add_argument("--requests", type=positive_int, default=4000, help="requests per window at the default point")
    parser.add_argument("--windows", type=positive_int, default=5,
                        help="disjoint windows (4,000 requests apart, closer on a short trace) at the default point")
    parser.add_argument("--time-scale", type=positive_float, default=1.0, help="divide arrival times by this")
    parser.add_argument("--event-delay-ms", type=non_negative_float, default=50.0,
                        help="virtual delay before a tier change reaches the index")
    parser.add_argument("--ttft-slo-ms", type=non_negative_float, default=2000.0,
                        help="goodput's SLO: TTFT within this of the prompt's prefill time alone")
    parser.add_argument("--variants", type=subset(all_names), default=all_names,
                        help="comma-separated subset (default: all nine)")
    parser.add_argument("--speed", type=positive_float, default=d.speed, help="step times divided by this")
    parser.add_argument("--inter-rack-gbytes-per-s", type=positive_float, default=d.inter_rack_bytes_per_s / 1e9)
    parser.add_argument("--cpu-tier-blocks", type=positive_int, default=d.cpu_tier_blocks,
                        help="each node's CPU tier, in 512-token blocks whatever --trace-block-tokens")
    parser.add_argument("--gpu-kv-blocks", type=positive_int, default=d.gpu_kv_blocks,
                        help="each engine's GPU KV memory, in 512-token blocks whatever --trace-block-tokens")
    parser.add_argument("--no-sweep", action="store_true", help="the default point only")
    parser.add_argument("--sweep-requests", type=positive_int, default=1000, help="requests per window in the sweep")
    parser.add_argument("--sweep-windows", type=positive_int, default=5,
                        help="disjoint windows (4,000 requests apart, closer on a short trace) per sweep point")
    parser.add_argument("--sweep-variants", type=subset(all_names), default=VARIANTS)
    parser.add_argument("--sweep-params", type=subset(list(PARAMS)), default=list(PARAMS),
                        help="comma-separated subset of the swept parameters (the load is always swept)")
    parser.add_argument("--sweep-loads", type=_loads, default=LOAD_CURVE,
                        help="comma-separated time scales of the load curve")
    parser.add_argument("--control-plane", choices=("in-process", "real"), default="in-process",
                        help="real: also replay the first window through a control-plane process")
    parser.add_argument("--jobs", type=positive_int, default=2, help="worker processes")
    parser.add_argument("--out", default="replay-out", help="directory for replay.json and replay.png")
    parser.add_argument("--json", action="store_true", help="end with one JSON line (always printed last)")
    return parser


def _loads(text: str) -> list[float]:
    return [positive_float(x) for x in text.split(",")]


def _ci(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _arrivals(trace: Path, starts: tuple[int, ...], requests: int, fmt: TraceFormat) -> dict:
    """The default point's windows' arrivals checked (within a day, at most MAX_REQUESTS_PER_S a second) before any
    run starts; their mean rate and peak, for the report."""
    found = [check_arrivals(trace, s, load_window(trace, s, requests, fmt=fmt), fmt) for s in starts]
    rates = [a.rate_rps for a in found if a.rate_rps is not None]
    return {"arrival_rate_rps": round(sum(rates) / len(rates), 3) if rates else None,
            "peak_requests_per_s": max(a.peak_per_s for a in found)}


def _rate_line(fmt: TraceFormat, arrivals: dict) -> str:
    rate = arrivals["arrival_rate_rps"]
    return (f"arrivals {'all at once' if rate is None else f'{rate:.3g} requests/s'}, at most "
            f"{arrivals['peak_requests_per_s']} in a second (timestamps in {fmt.time_unit}, "
            f"{fmt.block_tokens} tokens a hash id)")


def main(argv: list[str]) -> int:
    # every input checked (the whole trace too) before any run starts (bad input: run_command's one line, exit 2)
    args = _parser().parse_args(argv)
    fmt = format_of(args)
    trace = Path(args.trace)
    profile = Profile(speed=args.speed, inter_rack_bytes_per_s=args.inter_rack_gbytes_per_s * 1e9,
                      cpu_tier_blocks=args.cpu_tier_blocks, gpu_kv_blocks=args.gpu_kv_blocks,
                      block_tokens=fmt.block_tokens)
    info = scan(trace, fmt)
    info.check_fits(profile.gpu_blocks, profile.block_tokens, "--gpu-kv-blocks", args.gpu_kv_blocks)
    plan = select_windows(info, args.start, args.windows, args.requests)
    arrivals = _arrivals(trace, plan.starts, plan.requests, fmt)
    sweep_plan = None if args.no_sweep else select_windows(info, args.start, args.sweep_windows,
                                                           args.sweep_requests)
    for s in sweep_plan.starts if sweep_plan else ():   # the load curve is in multiples of each one's rate
        window = load_window(trace, s, sweep_plan.requests, fmt=fmt)
        if check_arrivals(trace, s, window, fmt).rate_rps is None:
            raise TraceError(f"{args.trace}: requests {s} to {s + sweep_plan.requests - 1} all arrive at one "
                             f"time, so the sweep's arrival rates are undefined (--no-sweep: the default point "
                             f"only; or more --sweep-requests)")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {args.out}: {exc.strerror or exc}") from None
    started = time.monotonic()
    names = args.variants
    base = RunSpec(str(trace), "", profile, args.engines, args.start, plan.requests, args.time_scale,
                   args.event_delay_ms, trace_format=fmt)
    windows = list(plan.starts)
    specs = [dataclasses.replace(base, variant=n, start=s, seed=w) for n in names for w, s in enumerate(windows)]
    rows = run_many(specs, args.ttft_slo_ms, args.jobs)
    by_name = {n: rows[i * len(windows):(i + 1) * len(windows)] for i, n in enumerate(names)}
    policies = {n: combine(r) for n, r in by_name.items()}
    if BASELINE in names:   # the same windows and seeds for every variant: paired differences
        for n in names:
            if n != BASELINE:
                policies[n]["vs_cost_aware"] = paired(by_name[n], by_name[BASELINE])
    result: dict = {
        "policies": policies,
        "profile": {**profile.as_dict(), "engines": args.engines, "min_cached_token_delta":
                    baseline_settings(profile, args.engines).route_min_cached_token_delta},
        "trace": {"path": str(trace), **plan.as_dict(), **fmt.as_dict(), **arrivals, "time_scale": args.time_scale,
                  "event_delay_ms": args.event_delay_ms, "ttft_slo_ms": args.ttft_slo_ms,
                  "block_hashes": f"sha256(parent || hash_id as 8 bytes), full {fmt.block_tokens}-token blocks only"},
    }
    if args.control_plane == "real":
        result["control_plane"] = control_plane_check(dataclasses.replace(base, start=windows[0]), names,
                                                      args.ttft_slo_ms, speculative_ttl_ms=200)
    if sweep_plan is not None:
        result["trace"]["sweep"] = sweep_plan.as_dict()
        sweep_base = dataclasses.replace(base, requests=sweep_plan.requests)
        result["sweep"] = sweep(sweep_base, args.sweep_variants, list(sweep_plan.starts), args.ttft_slo_ms, args.jobs,
                                {k: v for k, v in PARAMS.items() if k in args.sweep_params}, args.sweep_loads)
        result["sweep_winners"] = winners(result["sweep"])
    result["wall_s"] = round(time.monotonic() - started, 1)
    (out / "replay.json").write_text(json.dumps(result, indent=2) + "\n")
    from kvmesh_apps.replay.plot import write_plot
    plot_note = write_plot(result, out / "replay.png")
    print(f"profile: {profile.name}; {args.engines} engines; windows {windows} of {plan.requests} requests; "
          f"{_rate_line(fmt, arrivals)}")
    for what, p in (("", plan), ("sweep: ", sweep_plan)):
        if p is not None and p.note:
            print(f"note: {what}{p.note}")
    print(f"{'policy':<20}{'good/s':>8}{'±95%':>7}{'SLO %':>7}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
          f"{'wait p90':>10}{'saved Mtok':>11}{'slow pulls':>11}{'stale':>7}")
    for name, r in policies.items():
        print(f"{name:<20}{r['goodput_rps']:>8.2f}{_ci(r['goodput_rps_ci95']):>7}{100 * r['slo_attainment']:>7.1f}"
              f"{r['ttft_p50_ms']:>9.0f}{r['ttft_p90_ms']:>9.0f}{r['ttft_p99_ms']:>9.0f}{r['wait_p90_ms']:>10.0f}"
              f"{r['prefill_tokens_saved'] / 1e6:>11.2f}{r['pulls_slower_than_recompute']:>11}"
              f"{r['stale_route_rate']:>7.3f}")
    for w in result.get("sweep_winners", []):
        print(f"sweep {json.dumps(w['point'])}: best goodput {w['best_goodput']}, "
              f"highest SLO-meeting rate {w['best_max_slo_rate']}")
    print(f"wrote {out / 'replay.json'}; {plot_note}")
    print(json.dumps(result) if args.json else f"wall time {result['wall_s']} s")
    return 0
