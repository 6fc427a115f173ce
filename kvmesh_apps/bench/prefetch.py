"""``kvmesh bench prefetch [--json]``: route-time prefetch against pull-on-ask and recompute, on real vLLM CPU engines.

A local fleet (Redis, control plane, two data planes, mutual TLS) and two vLLM CPU engines on a random-weight tiny
Llama: ``src`` on dp1 computes every prefix once (its connector saves them to dp1) and is then stopped; ``dst`` on
dp2 serves every measured request. Per repetition, each mode (in a rotated order) sends ``--requests`` requests
(a ``--prefix-tokens`` prefix dp1 holds + a fresh 32-token suffix, ``--max-tokens`` output tokens) to ``dst`` one
every ``--spacing-ms`` (default: 0.7 of a pulled request's median service time in a warm-up, so requests queue in
the engine), through the engine host's ``concurrent`` op:

* ``recompute``: no source (the engine prefills the whole prompt);
* ``pull``: the source Route named (``prefetch=False``): the engine pulls when its scheduler first examines the
  request (pull-on-ask);
* ``prefetch``: the same source, and at each request's arrival the driver calls ``Route`` (``prefetch=True``):
  ``SchedulerClient`` hands the order to dp2, which starts the pull then; the engine's ask joins it.

TTFT is the first token's time minus the request's arrival, both in the engine process. Each mode's per-repetition
p50 and p90 are averaged over the repetitions with a 95 % interval (Student t); ``paired_delta_p50_ms`` is
prefetch minus pull per repetition (same repetition, same load), with its interval. Bytes prefetched, used (acquired
by the engine) and wasted (not acquired within dp2's use window) come from dp2's metrics. The link is loopback,
unshaped. With ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from control_plane.scheduler_client import Candidate, Policy, SchedulerClient
from engine_connector.config import KV_LAYOUT
from kvmesh.channels import channel
from kvmesh.command_line import Parser, positive_int, run_command
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc
from kvmesh_apps.engine_host import DTYPE, BLOCK_SIZE
from kvmesh_apps.fleet import Fleet
from kvmesh_apps.kv_shape import KVShape
from kvmesh_apps.replay.runs import mean_ci, pct
from kvmesh_apps.tiny_model import build_tiny_llama
from tenancy.api_keys import new_key

MODES = ("recompute", "pull", "prefetch")
SUFFIX_TOKENS = 32
USE_WINDOW_MS = 3_000  # dp2's prefetch_use_window_ms: wasted bytes are settled this long after they land
NO_SAVE = {"kvmesh": {"save": False}}  # dst keeps nothing in dp2 of its own: each mode finds dp2 as it was


def _ttft_ms(result: dict[str, Any]) -> float:
    return 1000.0 * (result["token_times"][0] - result["added_s"])


def _interval(values: list[float]) -> dict[str, Any]:
    mean, half = mean_ci(values)
    return {"mean": round(mean, 1), "ci95": None if half is None else [round(mean - half, 1), round(mean + half, 1)],
            "per_repetition": [round(v, 1) for v in values]}


def _scrape(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


async def _scheduler_key(fleet: Fleet) -> str:
    async with channel(fleet.control_plane.address, fleet.admin_key, fleet.client_tls()) as ch:
        reply = await ta_grpc.TenantAdminStub(ch).IssueKey(ta_pb.IssueKeyRequest(
            role=ta_pb.ROLE_SCHEDULER, tenant_id=fleet.tenant))
    return reply.secret


async def _routes(client: SchedulerClient, prompts: list[list[int]], prefetch: bool, at_s: list[float] | None = None
                  ) -> list:
    """Route each prompt to dst (at ``at_s[i]`` after now, when given); the decisions."""
    t0 = time.perf_counter()
    decisions = []
    for i, prompt in enumerate(prompts):
        if at_s is not None:
            await asyncio.sleep(max(0.0, t0 + at_s[i] - time.perf_counter()))
        decisions.append(await client.route([Candidate("dst", "dp2")], token_ids=prompt, policy=Policy.LOAD_AWARE,
                                            min_cached_token_delta=BLOCK_SIZE, prefetch=prefetch))
    return decisions


def run(args: argparse.Namespace, say) -> dict[str, Any]:
    model = build_tiny_llama(Path(args.model_dir) / "tiny-prefetch", num_layers=args.layers)
    shape = KVShape.from_checkpoint(model, dtype=DTYPE)
    block_bytes = shape.block_bytes(BLOCK_SIZE)
    rng = np.random.default_rng(args.seed)
    draw = lambda n: rng.integers(2, 2048, n).tolist()  # noqa: E731
    reps, n = args.repetitions, args.requests
    prefixes = {(r, m, i): draw(args.prefix_tokens) for r in range(reps + 1) for m in MODES for i in range(n)}
    prompts = {key: prefix + draw(SUFFIX_TOKENS) for key, prefix in prefixes.items()}
    os.environ["KVMESH_DP_PREFETCH_USE_WINDOW_MS"] = str(USE_WINDOW_MS)
    # each prefetch-mode prompt is routed twice (for its kv_transfer_params up front, and at its arrival to hand the
    # order over): no speculative entry from the first may make the second see the prefix as held on dst already
    os.environ["KVMESH_CP_ROUTE_SPECULATIVE_TTL_MS"] = "0"
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-prefetch-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        held = sum(1 for (_, mode, _) in prefixes if mode != "recompute")
        fleet = Fleet(workdir, 2, new_key()[1], tenant="bench", block_bytes=block_bytes, block_tokens=BLOCK_SIZE,
                      capacity=f"{(held + 4) * (args.prefix_tokens // BLOCK_SIZE + 2) * block_bytes}")
        try:
            fleet.start()
            say("starting the holder engine (src on dp1); it computes every prefix once ...")
            src = fleet.start_engine("src", model, "dp1").wait_ready()
            for (r, mode, i), prefix in prefixes.items():
                if mode != "recompute":
                    src.generate(prefix, 1)
            fleet.stop_engine("src")
            say("starting the measured engine (dst on dp2) ...")
            dst = fleet.start_engine("dst", model, "dp2", max_num_seqs=args.max_num_seqs,
                                     connector={"pull_timeout_ms": 5000}).wait_ready()
            ns = Namespace(fleet.tenant, str(model), "random-init", CacheConfig(
                block_size=BLOCK_SIZE, kv_dtype=shape.dtype, kv_layout=KV_LAYOUT, parallel_layout="tp1-pp1",
                hash_seed=os.environ.get("PYTHONHASHSEED", ""))).validate()
            key = asyncio.run(_scheduler_key(fleet))
            result = asyncio.run(_measure(args, say, fleet, dst, ns, key, prompts))
            time.sleep(USE_WINDOW_MS / 1000 + 1.5)  # every prefetch settled: used, or counted wasted
            metrics = _scrape(fleet.metrics()["dp2"])
        finally:
            fleet.stop()
    counted = {kind: metrics.get(f'kvmesh_dp_prefetch_bytes_total{{kind="{kind}"}}', 0.0)
               for kind in ("prefetched", "used", "wasted")}
    result.update(
        bytes_prefetched=int(counted["prefetched"]), bytes_used=int(counted["used"]),
        bytes_wasted=int(counted["wasted"]),
        wasted_bytes_fraction=round(counted["wasted"] / counted["prefetched"], 4) if counted["prefetched"] else None,
        prefetches={k.split('"')[1]: int(v) for k, v in metrics.items() if k.startswith("kvmesh_dp_prefetches_total")},
        model=f"tiny Llama ({args.layers} layers, {shape.bytes_per_token()} KV bytes per token, {block_bytes // 1024} "
              f"KiB blocks)", prefix_tokens=args.prefix_tokens, suffix_tokens=SUFFIX_TOKENS,
        max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs, repetitions=reps, requests_per_mode=n,
        link="loopback, unshaped (UCX over lo)")
    return result


async def _measure(args, say, fleet: Fleet, dst, ns: Namespace, key: str, prompts: dict) -> dict[str, Any]:
    reps, n = args.repetitions, args.requests
    async with SchedulerClient(fleet.control_plane.address, ns, api_key=key, tls=fleet.client_tls()) as client:
        # warm-up (repetition index ``reps``, discarded): compiles, the first NIXL connection, service times
        warm = {m: [prompts[(reps, m, i)] for i in range(n)] for m in MODES}
        pulled = await _routes(client, warm["pull"], prefetch=False)
        assert all(d.source is not None for d in pulled), "Route named no source: dp1 does not hold the prefixes"
        took = []
        for prompt, d in zip(warm["pull"], pulled):
            t = time.perf_counter()
            await asyncio.to_thread(dst.generate, prompt, args.max_tokens, {**d.kv_transfer_params(), **NO_SAVE})
            took.append(time.perf_counter() - t)
        service_s = statistics.median(took)  # the first ones pay one-time costs (compiles, the first connection)
        for prompt in warm["recompute"]:
            await asyncio.to_thread(dst.generate, prompt, args.max_tokens, NO_SAVE)
        spacing_s = args.spacing_ms / 1000 if args.spacing_ms else 0.7 * service_s
        say(f"a pulled request takes {service_s * 1000:.0f} ms alone; one arrives every {spacing_s * 1000:.0f} ms")
        at_s = [i * spacing_s for i in range(n)]
        ttft: dict[str, list[list[float]]] = {m: [] for m in MODES}
        statuses: dict[str, int] = {}
        for r in range(reps):
            for mode in MODES[r % 3:] + MODES[:r % 3]:  # rotated: no mode always runs first
                mine = [prompts[(r, mode, i)] for i in range(n)]
                params = [NO_SAVE] * n
                if mode != "recompute":
                    decisions = await _routes(client, mine, prefetch=False)
                    params = [{**d.kv_transfer_params(), **NO_SAVE} for d in decisions]
                requests = [{"id": f"{mode}-{r}-{i}", "prompt": p, "max_tokens": args.max_tokens,
                             "kv_transfer_params": q, "at_s": at_s[i]} for i, (p, q) in enumerate(zip(mine, params))]
                serving = asyncio.ensure_future(asyncio.to_thread(dst.concurrent, requests))
                if mode == "prefetch":  # Route at each arrival hands the order to dp2
                    for d in await _routes(client, mine, prefetch=True, at_s=at_s):
                        statuses[d.prefetch_status or "none"] = statuses.get(d.prefetch_status or "none", 0) + 1
                results = await serving
                ttft[mode].append([_ttft_ms(results[q["id"]]) for q in requests])
            say(f"repetition {r + 1}/{reps}: p50 " + ", ".join(
                f"{m} {statistics.median(ttft[m][-1]):.0f} ms" for m in MODES))
    p50 = {m: [pct(v, 0.5) for v in ttft[m]] for m in MODES}
    p90 = {m: [pct(v, 0.9) for v in ttft[m]] for m in MODES}
    return {
        "modes": {m: {"ttft_p50_ms": _interval(p50[m]), "ttft_p90_ms": _interval(p90[m])} for m in MODES},
        "paired_delta_p50_ms": _interval([a - b for a, b in zip(p50["prefetch"], p50["pull"])]),
        "paired_delta_p50_vs_recompute_ms": _interval([a - b for a, b in zip(p50["prefetch"], p50["recompute"])]),
        "paired_delta_p90_ms": _interval([a - b for a, b in zip(p90["prefetch"], p90["pull"])]),
        "prefetch_statuses": statuses,
        "arrival_spacing_ms": round(spacing_s * 1000, 1),
        "pulled_request_service_ms": round(service_s * 1000, 1),
    }


def main(argv: list[str]) -> int:
    parser = Parser(prog="kvmesh bench prefetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object (progress goes to stderr)")
    parser.add_argument("--model-dir", default=".kvmesh/models", help="where built models are kept (reused)")
    parser.add_argument("--layers", type=positive_int, default=4, help="layers of the tiny model (KV bytes per token)")
    parser.add_argument("--prefix-tokens", type=positive_int, default=1024, help="tokens dp1 holds per prompt")
    parser.add_argument("--requests", type=positive_int, default=6, help="requests per mode and repetition")
    parser.add_argument("--repetitions", type=positive_int, default=5)
    parser.add_argument("--max-tokens", type=positive_int, default=16, help="output tokens per request")
    parser.add_argument("--max-num-seqs", type=positive_int, default=1, help="dst's concurrent requests")
    parser.add_argument("--spacing-ms", type=float, default=0.0, help="between arrivals (0: 0.7 x service time)")
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--workdir", default="", help="logs of the fleet and engines (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    if args.prefix_tokens % BLOCK_SIZE:
        parser.error(f"--prefix-tokens must be a multiple of {BLOCK_SIZE}")
    out = sys.stderr if args.json else sys.stdout
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    started = time.perf_counter()
    result = run(args, say)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        for key, value in result.items():
            say(f"  {key:<34} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command("kvmesh bench prefetch", main, sys.argv[1:]))  # one line for any error, as `kvmesh` gives
