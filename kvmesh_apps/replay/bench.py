"""``kvmesh bench replay --trace PATH [--engines 8] [--json]``: policies compared on a real trace.

A real redis-server and a real control-plane process; this process simulates
the engines (:mod:`kvmesh_apps.replay.sim`) for every variant at once, each in its
own namespace and node ids, so one control plane serves them all concurrently.
The trace is sampled as one contiguous window (``--start``, ``--requests``)
replayed at its own pace (``--time-scale`` > 1 compresses it). Writes
``replay.json`` and ``replay.png`` to ``--out``; the last line printed is the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from kvmesh.grpc_server import channel_options
from kvmesh_apps.procs import ServiceProcess
from kvmesh_apps.redis_server import RedisServer
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.sim import Simulation, Totals, Variant, variants
from kvmesh_apps.replay.trace import BlockHashes, load_window
from control_plane.scheduler_client import SchedulerClient
from kvmesh.v1 import control_plane_pb2_grpc as pb_grpc, tenant_admin_pb2, tenant_admin_pb2_grpc
from tenancy.api_keys import new_key


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def summarize(t: Totals, ttft_slo_ms: float) -> dict:
    span_s = max(1e-9, (t.last_finish_ms - t.first_arrival_ms) / 1000.0)
    prompt = max(1, t.prompt_tokens)
    return {
        "ttft_p50_ms": round(_pct(t.ttft_ms, 0.50), 1),
        "ttft_p99_ms": round(_pct(t.ttft_ms, 0.99), 1),
        "throughput_rps": round(len(t.ttft_ms) / span_s, 3),
        "goodput_rps": round(sum(x <= ttft_slo_ms for x in t.ttft_ms) / span_s, 3),
        "prefill_tokens_saved": t.prompt_tokens - t.computed_tokens,
        "bytes_moved": t.bytes_moved,
        "stale_route_rate": round(t.stale_routes / t.routes_with_source, 4) if t.routes_with_source else 0.0,
        "hit_rate_by_tier": {"gpu": round(t.gpu_tokens / prompt, 4), "local_cpu": round(t.local_cpu_tokens / prompt, 4),
                             "peer": round(t.peer_tokens / prompt, 4)},
        "routes_with_source": t.routes_with_source,
        "route_rpc_p50_ms": round(_pct(t.route_rpc_ms, 0.50), 2),
        "requests": len(t.ttft_ms),
    }


async def _replay(args, profile: Profile, cp_address: str, key: str) -> dict[str, Totals]:
    requests = load_window(Path(args.trace), args.start, args.requests, args.time_scale)
    hashes = BlockHashes()
    metadata = (("authorization", f"Bearer {key}"),)
    run_id = uuid.uuid4().hex[:8]
    chosen = [v for v in variants() if not args.variants or v.name in args.variants.split(",")]
    async with grpc.aio.insecure_channel(cp_address, options=channel_options()) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)
        await tenant_admin_pb2_grpc.TenantAdminStub(channel).CreateTenant(
            tenant_admin_pb2.CreateTenantRequest(tenant_id="replay"), metadata=metadata)
        sims: list[tuple[Variant, Simulation]] = []
        for v in chosen:
            client = SchedulerClient(cp_address, Simulation.namespace(v, run_id), api_key=key, timeout_s=30.0)
            sims.append((v, Simulation(v, requests, hashes, profile, args.engines, client, stub, metadata,
                                       args.event_delay_ms)))
        try:
            results = await asyncio.gather(*(s.run() for _, s in sims))
        finally:
            for _, s in sims:
                await s.client.close()
    return {v.name: r for (v, _), r in zip(sims, results)}


def _profile(args) -> Profile:
    return dataclasses.replace(
        Profile(), prefill_tokens_per_s=args.prefill_tokens_per_s, kv_bytes_per_token=args.kv_bytes_per_token,
        inter_rack_bytes_per_s=args.inter_rack_gbytes_per_s * 1e9, cpu_tier_blocks=args.cpu_tier_blocks)


def main(argv: list[str]) -> int:
    d = Profile()
    parser = argparse.ArgumentParser(prog="kvmesh bench replay", description=__doc__.split("\n")[0])
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--start", type=int, default=0, help="first request of the window (line number)")
    parser.add_argument("--requests", type=int, default=4000, help="requests in the window")
    parser.add_argument("--time-scale", type=float, default=1.0, help="divide arrival times by this")
    parser.add_argument("--event-delay-ms", type=float, default=50.0,
                        help="virtual delay before a tier change reaches the index")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT bound of goodput_rps")
    parser.add_argument("--variants", default="", help="comma-separated subset (default: all nine)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s)
    parser.add_argument("--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token)
    parser.add_argument("--inter-rack-gbytes-per-s", type=float, default=d.inter_rack_bytes_per_s / 1e9)
    parser.add_argument("--cpu-tier-blocks", type=int, default=d.cpu_tier_blocks)
    parser.add_argument("--out", default="replay-out", help="directory for replay.json and replay.png")
    parser.add_argument("--json", action="store_true", help="end with one JSON line (always printed last)")
    args = parser.parse_args(argv)
    profile = _profile(args)
    started = time.monotonic()
    _, key, _ = new_key()
    with tempfile.TemporaryDirectory(prefix="kvmesh-replay-") as tmp:
        redis = RedisServer(Path(tmp) / "redis").start()
        cp = ServiceProcess(["control-plane", "--listen", "127.0.0.1:0", "--redis-url", redis.url,
                             "--lease-ms", "86400000", "--key-prefix", "replay"],
                            env={"KVMESH_CP_ADMIN_KEY": key}, log_path=Path(tmp) / "cp.log")
        try:
            cp.start()
            totals = asyncio.run(_replay(args, profile, cp.address, key))
        finally:
            cp.stop()
            redis.stop()
    result = {
        "policies": {name: summarize(t, args.ttft_slo_ms) for name, t in totals.items()},
        "profile": {**profile.as_dict(), "engines": args.engines},
        "trace": {"path": str(args.trace), "start": args.start, "requests": args.requests,
                  "time_scale": args.time_scale, "event_delay_ms": args.event_delay_ms,
                  "ttft_slo_ms": args.ttft_slo_ms,
                  "block_hashes": "sha256(parent || hash_id as 8 bytes), full 512-token blocks only"},
        "wall_s": round(time.monotonic() - started, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(json.dumps(result, indent=2) + "\n")
    from kvmesh_apps.replay.plot import write_plot
    plot_note = write_plot(result, out / "replay.png")
    print(f"profile: {profile.name}; {args.engines} engines; {json.dumps(profile.as_dict())}")
    print(f"{'policy':<20}{'TTFT p50 ms':>12}{'p99 ms':>10}{'req/s':>8}{'good/s':>8}{'saved tok':>12}"
          f"{'GB moved':>10}{'stale':>7}")
    for name, r in result["policies"].items():
        print(f"{name:<20}{r['ttft_p50_ms']:>12.0f}{r['ttft_p99_ms']:>10.0f}"
              f"{r['throughput_rps']:>8.2f}{r['goodput_rps']:>8.2f}"
              f"{r['prefill_tokens_saved']:>12}{r['bytes_moved'] / 1e9:>10.1f}{r['stale_route_rate']:>7.3f}")
    print(f"wrote {out / 'replay.json'}; {plot_note}")
    print(json.dumps(result) if args.json else f"wall time {result['wall_s']} s")
    return 0
