"""``kvmesh bench prefetch [--json]``: route-time prefetch against pull-on-ask and recompute, on real vLLM CPU
engines over a shaped link (root: Linux network namespaces).

The fleet of ``kvmesh bench routing`` (:mod:`kvmesh_apps.bench.shaped_fleet`): Redis and the control plane here,
nodes ``n1`` and ``n2`` each a network namespace with its data plane and a vLLM CPU engine on a random-weight tiny
Llama. Pulls cross the kernel's TCP stack between the namespaces (NIXL over UCX's TCP transport), shaped by ``tc``
(HTB) to ``--link-mbit`` each way; ``--link-delay-ms`` adds that much delay to each direction (``tc netem`` where
the kernel has it, else :mod:`kvmesh_apps.netdelay`). ``src`` on ``n1`` computes every prefix once (its connector
saves them to n1's data plane) and is then stopped; ``dst`` on ``n2`` serves every measured request. Per
repetition, each mode (in a rotated order) sends ``--requests`` requests (a ``--prefix-tokens`` prefix n1 holds + a
fresh 32-token suffix, ``--max-tokens`` output tokens) to ``dst`` one every ``--spacing-ms`` (default: :data:`PACE`
x what a pulled request alone costs the engine beyond its pull, warm-up medians: requests queue in the engine in
every mode, and the link is not the bottleneck), through the engine host's ``concurrent`` op:

* ``recompute``: no source (the engine prefills the whole prompt);
* ``pull``: the source Route named (``prefetch=False``): the engine pulls when its scheduler first examines the
  request (pull-on-ask), i.e. when a running slot frees;
* ``prefetch``: the same source, and at each request's arrival the driver calls ``Route`` (``prefetch=True``):
  ``SchedulerClient`` hands the order to n2's data plane, which starts the pull then, while the request waits in
  the engine's queue; the engine's ask joins it or finds it landed.

The same prompts' shapes, arrival times and order in every mode of a repetition (each mode its own token ids:
nothing cached carries over). TTFT is the first token's time minus the request's arrival, both in the engine
process. Each mode's per-repetition p50 and p90 are averaged over the repetitions with a 95 % interval (Student
t); ``paired_delta_p50_ms`` is prefetch minus pull per repetition (same repetition, same load), with its interval.
Bytes prefetched, used (acquired by the engine) and wasted (not acquired within n2's use window) come from n2's
data-plane metrics; per mode, the connector's own reports (its Pull's time, bytes it moved, blocks it joined).
With ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
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
from kvmesh.command_line import Parser, UsageError, non_negative_float, positive_float, positive_int, run_command
from kvmesh_apps.bench.figures import finish, interval_record, load_report, progress
from kvmesh_apps.bench.shaped_fleet import ShapedFleet
from kvmesh_apps.engine_host import BLOCK_SIZE, DTYPE
from kvmesh_apps.kv_shape import KVShape
from kvmesh_apps.replay.runs import pct
from kvmesh_apps.tiny_model import build_tiny_llama

PROG = "kvmesh bench prefetch"
MODES = ("recompute", "pull", "prefetch")
SUFFIX_TOKENS = 32
USE_WINDOW_MS = 3_000  # n2's prefetch_use_window_ms: wasted bytes are settled this long after they land
NO_SAVE = {"kvmesh": {"save": False}}  # dst keeps nothing of its own in n2: each mode finds n2 as it was
SRC, DST = "n1", "n2"
# one KV head of 64 (512 bytes of fp32 KV per token and layer) under a 512-wide model: a prefix's prefill costs about
# what its pull does (at --link-mbit 160 a 1,024-token prefix pulls in ~120 ms; its prefill took 100-200 ms in the
# runs here), as with a real GQA model on a real link, so the pull is a large share of TTFT
MODEL = dict(hidden=512, heads=8, kv_heads=1)
# arrivals every PACE x what a pulled request costs the engine beyond its pull (warm-up medians): faster than the
# engine serves in every mode, so requests queue in it and a pull started at arrival has a queue wait to hide in,
# while the link (one prefix's wire time per arrival) is not the bottleneck
PACE = 0.85


def _ttft_ms(result: dict[str, Any]) -> float:
    return 1000.0 * (result["token_times"][0] - result["added_s"])


def _scrape(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


async def _routes(client: SchedulerClient, prompts: list[list[int]], prefetch: bool, at_s: list[float] | None = None
                  ) -> list:
    """Route each prompt to dst (at ``at_s[i]`` after now, when given); the decisions."""
    t0 = time.perf_counter()
    decisions = []
    for i, prompt in enumerate(prompts):
        if at_s is not None:
            await asyncio.sleep(max(0.0, t0 + at_s[i] - time.perf_counter()))
        decisions.append(await client.route([Candidate(DST, DST)], token_ids=prompt, policy=Policy.LOAD_AWARE,
                                            min_cached_token_delta=BLOCK_SIZE, prefetch=prefetch))
    return decisions


def run(args: argparse.Namespace, say) -> dict[str, Any]:
    model = build_tiny_llama(Path(args.model_dir) / f"tiny-prefetch-{args.layers}l-gqa", num_layers=args.layers,
                             **MODEL)
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
    held = sum(1 for (_, mode, _) in prefixes if mode != "recompute")
    capacity = (held + 4) * (args.prefix_tokens // BLOCK_SIZE + 2) * block_bytes
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-prefetch-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        fleet = ShapedFleet(workdir, 2, lambda a, b: args.link_mbit, args.prefix_tokens + SUFFIX_TOKENS +
                            args.max_tokens + BLOCK_SIZE, block_bytes, tenant="bench", capacity=str(capacity),
                            delay_ms={SRC: args.link_delay_ms, DST: args.link_delay_ms},
                            engines={SRC: {}, DST: {"max_num_seqs": args.max_num_seqs,
                                                    "connector": {"pull_timeout_ms": 5000}}})
        try:
            say(f"starting the fleet: 2 namespaces, {args.link_mbit:g} Mbit/s link"
                f"{f', +{args.link_delay_ms:g} ms each way' if args.link_delay_ms else ''}, 2 vLLM engines ...")
            fleet.start(model)
            say("the holder engine (src on n1) computes every prefix once ...")
            src = fleet.engines[SRC]
            for (r, mode, i), prefix in prefixes.items():
                if mode != "recompute":
                    src.generate(prefix, 1)
            fleet.stop_engine(SRC)
            ns = fleet.namespace(model, shape)
            key = asyncio.run(fleet.scheduler_key())
            result = asyncio.run(_measure(args, say, fleet, ns, key, prompts))
            time.sleep(USE_WINDOW_MS / 1000 + 1.5)  # every prefetch settled: used, or counted wasted
            metrics = _scrape(fleet.metrics_url(DST))
        finally:
            fleet.stop()
    counted = {kind: metrics.get(f'kvmesh_dp_prefetch_bytes_total{{kind="{kind}"}}', 0.0)
               for kind in ("prefetched", "used", "wasted")}
    prefix_bytes = args.prefix_tokens // BLOCK_SIZE * block_bytes
    result.update(
        bytes_prefetched=int(counted["prefetched"]), bytes_used=int(counted["used"]),
        bytes_wasted=int(counted["wasted"]),
        wasted_bytes_fraction=round(counted["wasted"] / counted["prefetched"], 4) if counted["prefetched"] else None,
        prefetches={k.split('"')[1]: int(v) for k, v in metrics.items() if k.startswith("kvmesh_dp_prefetches_total")},
        link={"mbit": args.link_mbit, "delay_ms_each_way": args.link_delay_ms,
              "shaping": "tc htb per destination on each namespace's veth egress (NIXL over UCX TCP); delay: tc "
                         "netem where the kernel has it, else netdelay (NFQUEUE) on ingress",
              "prefix_bytes": prefix_bytes,
              "prefix_wire_ms": round(1000 * prefix_bytes * 8 / (args.link_mbit * 1e6), 1),
              "utilization": round(prefix_bytes * 8 / (args.link_mbit * 1e3) / result["arrival_spacing_ms"], 2)},
        model=f"tiny Llama ({args.layers} layers, {shape.bytes_per_token()} KV bytes per token, {block_bytes // 1024} "
              f"KiB blocks)", prefix_tokens=args.prefix_tokens, suffix_tokens=SUFFIX_TOKENS,
        max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs, repetitions=reps, requests_per_mode=n)
    return result


async def _measure(args, say, fleet: ShapedFleet, ns, key: str, prompts: dict) -> dict[str, Any]:
    reps, n = args.repetitions, args.requests
    dst = fleet.engines[DST]
    async with SchedulerClient(fleet.cp.address, ns, api_key=key) as client:
        # warm-up (repetition index ``reps``, discarded): compiles, the first NIXL connection, service times
        warm = {m: [prompts[(reps, m, i)] for i in range(n)] for m in MODES}
        pulled = await _routes(client, warm["pull"], prefetch=False)
        if not all(d.source is not None for d in pulled):
            raise RuntimeError(f"Route named no source: n1 does not hold the prefixes (logs in {fleet.workdir})")
        took, pull_ms = [], []
        for prompt, d in zip(warm["pull"], pulled):
            t = time.perf_counter()
            reply = await asyncio.to_thread(dst.generate, prompt, args.max_tokens,
                                            {**d.kv_transfer_params(), **NO_SAVE})
            took.append(time.perf_counter() - t)
            pull_ms.append(load_report(reply).get("pull_ms", 0.0))
        # medians: the first ones pay one-time costs (compiles, the first connection)
        service_s, pull_s = statistics.median(took), statistics.median(pull_ms) / 1000
        recomputed = []
        for prompt in warm["recompute"]:
            t = time.perf_counter()
            await asyncio.to_thread(dst.generate, prompt, args.max_tokens, NO_SAVE)
            recomputed.append(time.perf_counter() - t)
        spacing_s = args.spacing_ms / 1000 if args.spacing_ms else PACE * (service_s - pull_s)
        say(f"a pulled request takes {service_s * 1000:.0f} ms alone ({pull_s * 1000:.0f} ms of it its pull), a "
            f"recomputed one {statistics.median(recomputed) * 1000:.0f} ms; one arrives every "
            f"{spacing_s * 1000:.0f} ms")
        at_s = [i * spacing_s for i in range(n)]
        ttft: dict[str, list[list[float]]] = {m: [] for m in MODES}
        reports: dict[str, list[dict]] = {m: [] for m in MODES}
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
                if mode == "prefetch":  # Route at each arrival hands the order to n2
                    for d in await _routes(client, mine, prefetch=True, at_s=at_s):
                        statuses[d.prefetch_status or "none"] = statuses.get(d.prefetch_status or "none", 0) + 1
                results = await serving
                ttft[mode].append([_ttft_ms(results[q["id"]]) for q in requests])
                reports[mode] += [load_report(results[q["id"]]) for q in requests]
            say(f"repetition {r + 1}/{reps}: p50 " + ", ".join(
                f"{m} {statistics.median(ttft[m][-1]):.0f} ms" for m in MODES))
    p50 = {m: [pct(v, 0.5) for v in ttft[m]] for m in MODES}
    p90 = {m: [pct(v, 0.9) for v in ttft[m]] for m in MODES}
    return {
        "modes": {m: {"ttft_p50_ms": interval_record(p50[m]), "ttft_p90_ms": interval_record(p90[m]),
                      "connector": _connector_summary(reports[m])} for m in MODES},
        "paired_delta_p50_ms": interval_record([a - b for a, b in zip(p50["prefetch"], p50["pull"])]),
        "paired_delta_p90_ms": interval_record([a - b for a, b in zip(p90["prefetch"], p90["pull"])]),
        "paired_delta_p50_vs_recompute_ms": interval_record([a - b for a, b in zip(p50["prefetch"], p50["recompute"])]),
        "paired_delta_p50_pull_vs_recompute_ms": interval_record([a - b for a, b in zip(p50["pull"],
                                                                                         p50["recompute"])]),
        "prefetch_statuses": statuses,
        "arrival_spacing_ms": round(spacing_s * 1000, 1),
        "pulled_request_service_ms": round(service_s * 1000, 1),
        "pulled_request_pull_ms": round(pull_s * 1000, 1),
        "recomputed_request_service_ms": round(statistics.median(recomputed) * 1000, 1),
    }


def _connector_summary(reports: list[dict]) -> dict[str, Any]:
    """What the engine's connector saw, over a mode's requests: its Pull's time (p50), the bytes its own pulls
    moved, the blocks it joined (another pull on n2, i.e. a prefetch, was bringing them), tokens loaded from peers."""
    pulls = [r.get("pull_ms", 0.0) for r in reports if r.get("pull_ms")]
    return {"pull_ms_p50": round(pct(pulls, 0.5), 1) if pulls else None,
            "wait_ms_p50": round(pct([r.get("wait_ms", 0.0) for r in reports], 0.5), 1) if reports else None,
            "bytes_pulled": sum(r.get("bytes_pulled", 0) for r in reports),
            "joined_blocks": sum(r.get("joined_blocks", 0) for r in reports),
            "peer_tokens": sum(r.get("peer_tokens", 0) for r in reports),
            "local_tokens": sum(r.get("local_tokens", 0) for r in reports)}


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object (progress goes to stderr)")
    parser.add_argument("--model-dir", default=".kvmesh/models", help="where built models are kept (reused)")
    parser.add_argument("--layers", type=positive_int, default=4, help="layers of the tiny model (KV bytes per token)")
    parser.add_argument("--prefix-tokens", type=positive_int, default=1024, help="tokens n1 holds per prompt")
    parser.add_argument("--requests", type=positive_int, default=8, help="requests per mode and repetition")
    parser.add_argument("--repetitions", type=positive_int, default=5)
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="output tokens per request")
    parser.add_argument("--max-num-seqs", type=positive_int, default=1, help="dst's concurrent requests")
    parser.add_argument("--spacing-ms", type=non_negative_float, default=0.0,
                        help=f"between arrivals (0: {PACE} x a pulled request's service time less its pull's)")
    parser.add_argument("--link-mbit", type=positive_float, default=160.0, help="the n1-n2 link's rate, each way")
    parser.add_argument("--link-delay-ms", type=non_negative_float, default=0.0, help="added to each direction")
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--workdir", default="", help="logs of the fleet and engines (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    if args.prefix_tokens % BLOCK_SIZE:
        parser.error(f"--prefix-tokens must be a multiple of {BLOCK_SIZE}")
    if os.geteuid() != 0:
        raise UsageError("network namespaces need root: run it as root")
    say = progress(args.json)
    started = time.perf_counter()
    result = run(args, say)
    finish(result, started, args.json, say)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(PROG, main, sys.argv[1:]))  # one line for any error, as `kvmesh` gives
