"""``kvmesh bench sim-to-real [--json]``: the replay simulator's TTFT prediction against real vLLM CPU engines.

A scaled-down window of the trace (``--requests`` requests; each trace block (a
hash id: ``--trace-block-tokens``, 512 in Mooncake's traces) becomes ``--block-tokens``
tokens of random ids drawn from its hash id, so equal trace prefixes are equal
token prefixes) is replayed twice per policy:

- **real**: a local fleet (Redis, control plane, two data planes) and two vLLM
  CPU engines on a random-weight tiny Llama, each with the kvmesh connector on its
  own node. Every request is placed by a real ``Route`` call (the candidates'
  queues as this driver sees them) and sent with the answer's
  ``kv_transfer_params``; an engine serves one request at a time. With one
  output token, TTFT = time queued here + the request's time in the engine
  process (any pull included).
- **sim**: :class:`~kvmesh_apps.replay.sim.Simulation` with the same router in
  process, on a profile measured on those engines first: request time against
  prompt length (fitted per step, per token and per token of context) and the
  time of a peer pull. The two engines share this machine's cores, so the
  simulated engines do too (``Profile.shared_machine``: how much slower a step is
  while the other engine is busy, measured as both prefilling at once against one).

Arrivals are spaced so the two engines run at ``--load`` of their measured
capacity. Each policy gets its own token ids (nothing cached carries over). The
last line with ``--json`` is ``{"policies": {NAME: {"sim_ttft_p50_ms",
"real_ttft_p50_ms"}}, "max_p50_error", "rank_agreement", ...}`` (the fraction of policy pairs ordered
alike, a tie within 5 % its own verdict: :func:`rank_agreement`).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from control_plane.routing.config import RoutingSettings
from control_plane.routing.types import Candidate, EngineSample, LinkSample
from control_plane.scheduler_client import SchedulerClient
from engine_connector.config import KV_LAYOUT
from kvmesh.command_line import Parser, non_negative_int, positive_float, positive_int, subset
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.engine_host import BLOCK_SIZE, DTYPE, EngineProcess
from kvmesh_apps.fleet import Fleet
from kvmesh_apps.kv_shape import KVShape
from kvmesh_apps.replay.backends import InProcessBackend
from kvmesh_apps.replay.costs import FittedCosts
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.runs import mean_ci, pct
from kvmesh_apps.replay.sim import Simulation, variants
from kvmesh_apps.replay.trace import BlockHashes, TraceFormat, TraceRequest, add_format_arguments, format_of, \
    load_window, scan, select_windows
from kvmesh_apps.tiny_model import TinyLlamaSpec, build_tiny_llama
from tenancy.api_keys import new_key

POLICIES = ("cost-aware+p2p", "load-aware+p2p", "affinity-nop2p")
NODES = {"e1": "dp1", "e2": "dp2"}
PROG = "kvmesh bench sim-to-real"
CALIBRATION_LENGTHS = (64, 256, 512, 1024, 1536, 2048)


class Prompts:
    """Token ids of a scaled window: trace block ``h`` -> ``block_tokens`` ids drawn from (salt, h)."""

    def __init__(self, vocab: int, block_tokens: int, salt: int) -> None:
        self.vocab, self.block_tokens, self.salt = vocab, block_tokens, salt

    def of(self, r: TraceRequest, index: int) -> list[int]:
        ids: list[int] = []
        for h in r.hash_ids[: r.input_tokens // self.block_tokens]:
            ids += np.random.default_rng([self.salt, h]).integers(2, self.vocab, self.block_tokens).tolist()
        rest = r.input_tokens - len(ids)
        return ids + np.random.default_rng([self.salt, 1 << 40, index]).integers(2, self.vocab, rest).tolist()


TIE = 0.05   # two p50s within this fraction of their mean are a tie


def _verdict(a: float, b: float, ci: list[float] | None = None) -> int:
    """-1: ``a`` is faster, 1: slower, 0: a tie (the paired interval ``ci`` of a - b holds 0; without one,
    within :data:`TIE`)."""
    if ci is not None:
        return 0 if ci[0] <= 0 <= ci[1] else (1 if ci[0] > 0 else -1)
    if abs(a - b) <= TIE * (a + b) / 2:
        return 0
    return 1 if a > b else -1


def rank_agreement(real: dict[str, float], sim: dict[str, float],
                   real_ci: dict[str, list[float] | None] | None = None, baseline: str = "cost-aware") -> float:
    """The fraction of policy pairs the simulation orders as the real runs do, a tie being its own verdict
    (pairwise sign agreement; ``real_ci``: paired intervals of each policy's p50 minus ``baseline``'s, used for
    the pairs with the baseline). 1.0 with fewer than two policies."""
    names = list(real)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    if not pairs:
        return 1.0
    agree = 0
    for a, b in pairs:
        ci = None
        if real_ci and b == baseline and a in real_ci:
            ci = real_ci[a]
        elif real_ci and a == baseline and b in real_ci and real_ci[b] is not None:
            ci = [-real_ci[b][1], -real_ci[b][0]]
        agree += _verdict(real[a], real[b], ci) == _verdict(sim[a], sim[b])
    return round(agree / len(pairs), 3)


def paired_verdicts(per_unit: dict[str, list[float]]) -> dict[tuple[str, str], int]:
    """Per policy pair (a, b), a before b in ``per_unit``'s order: -1 if a is faster, 1 if slower, 0 a tie, from
    the 95 % Student-t interval of the paired differences a - b over the units (the same windows, in order): a tie
    when it holds 0; from one unit, :func:`_verdict`'s 5 % rule."""
    names = list(per_unit)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            diffs = [x - y for x, y in zip(per_unit[a], per_unit[b])]
            mean, half = mean_ci(diffs)
            if half is None:
                out[(a, b)] = _verdict(per_unit[a][0], per_unit[b][0])
            else:
                out[(a, b)] = _verdict(0.0, 0.0, [mean - half, mean + half])
    return out


def sign_agreement(real: dict[tuple[str, str], int], sim: dict[tuple[str, str], int]) -> float:
    """The fraction of policy pairs whose verdicts (:func:`paired_verdicts`) agree, a tie being its own verdict
    (pairwise sign agreement); 1.0 without pairs."""
    return round(sum(real[k] == sim[k] for k in real) / len(real), 3) if real else 1.0


def scaled_window(trace: Path, start: int, count: int, block_tokens: int, max_prompt: int,
                  output_tokens: int, fmt: TraceFormat = TraceFormat()) -> list[TraceRequest]:
    out = []
    for r in load_window(trace, start, count, fmt=fmt):
        tokens = min(max_prompt, max(block_tokens, r.input_tokens * block_tokens // fmt.block_tokens))
        out.append(TraceRequest(r.arrival_ms, tokens, output_tokens, r.hash_ids))
    return out


def _engine_ms(engine: EngineProcess, prompt: list[int], max_tokens: int, **kw) -> float:
    """Wall time of one request inside the engine process (prefill, any KV load, ``max_tokens`` tokens)."""
    return 1000.0 * engine.generate(prompt, max_tokens, reset_prefix_cache=True, **kw)["elapsed_s"]


def measure(fleet: Fleet, engines: dict[str, EngineProcess], vocab: int, kv_bytes: int, max_tokens: int) -> dict:
    """Request time against prompt length, each engine alone (fitted), and pulls of 1,024-token prefixes into e2.
    Every run has prompts of its own: a repeated one would be loaded from the node's CPU tier instead."""
    rng = np.random.default_rng(99)
    draw = lambda n: rng.integers(2, vocab, n).tolist()  # noqa: E731
    samples = []
    for n in CALIBRATION_LENGTHS:
        samples.append((n, statistics.median(_engine_ms(e, draw(n), max_tokens) for e in engines.values()
                                             for _ in range(2))))
    costs = FittedCosts.fit(samples)
    alone = statistics.median(_engine_ms(engines["e1"], draw(1024), max_tokens) for _ in range(3))
    with ThreadPoolExecutor(len(engines)) as pool:   # both engines prefilling at once on this machine's cores
        together = statistics.median(x for _ in range(3) for x in pool.map(
            lambda e: _engine_ms(e, draw(1024), max_tokens), list(engines.values())))
    prefixes = [draw(1024) for _ in range(3)]
    for prefix in prefixes:
        engines["e1"].generate(prefix, max_tokens)      # its blocks go to dp1's CPU tier
    time.sleep(0.5)
    host, port = fleet.data_planes["dp1"].address.rsplit(":", 1)
    pulled = []
    for i, prefix in enumerate(prefixes):
        source = {"remote_kv_source": {"kv_request_id": f"probe-{i}", "remote_host": host, "remote_port": int(port),
                                       "remote_node_id": "dp1"}}
        pulled.append(_engine_ms(engines["e2"], prefix + draw(64), max_tokens, kv_transfer_params=source))
    pull_ms = max(1.0, statistics.median(pulled) - costs.step_ms(64, [(64, 1024)], 0))
    return {"costs": costs, "samples": samples, "pull_ms_1024": pull_ms, "pulled_ms": pulled,
            "contention": max(0.0, together / alone - 1.0),
            "pull_bytes_per_s": 1024 * kv_bytes / (pull_ms / 1000.0)}


async def replay_real(fleet: Fleet, engines: dict[str, EngineProcess], ns: Namespace, window: list[TraceRequest],
                      prompts: Prompts, policy: str, max_tokens: int, kv_bytes: int, figures: dict) -> list[float]:
    variant = next(v for v in variants() if v.name == policy)
    queues = {e: asyncio.Queue() for e in engines}
    backlog = {e: [0, 0] for e in engines}       # waiting requests, prompt tokens to prefill
    ttft: list[float] = []

    async def serve(name: str) -> None:
        while True:
            item = await queues[name].get()
            if item is None:
                return
            arrived, prompt, params, planned = item
            started = time.perf_counter()
            backlog[name][0] -= 1
            reply = await asyncio.to_thread(engines[name].generate, prompt, max_tokens, params)
            backlog[name][1] -= planned
            ttft.append(1000.0 * (started - arrived + reply["elapsed_s"]))

    async with SchedulerClient(fleet.control_plane.address, ns, api_key=fleet.admin_key,
                               tls=fleet.client_tls()) as client:
        await client.report_stats(
            engines=[EngineSample(e, figures["prefill_tokens_per_s"]) for e in engines],
            links=[LinkSample(a, b, figures["pull_bytes_per_s"]) for a in NODES.values() for b in NODES.values()
                   if a != b])
        workers = [asyncio.create_task(serve(e)) for e in engines]
        t0 = time.perf_counter()
        for i, r in enumerate(window):
            await asyncio.sleep(max(0.0, t0 + r.arrival_ms / 1000.0 - time.perf_counter()))
            prompt = prompts.of(r, i)
            cands = [Candidate(e, NODES[e], backlog[e][0], backlog[e][1]) for e in engines]
            d = await client.route(cands, token_ids=prompt, policy=variant.policy, p2p=variant.p2p,
                                   kv_bytes_per_token=kv_bytes, kv_request_id=f"{policy}-{i}")
            cached = d.source.cached_tokens if d.source else d.local_cached_tokens
            planned = max(1, len(prompt) - cached)
            backlog[d.engine_id][0] += 1
            backlog[d.engine_id][1] += planned
            await queues[d.engine_id].put((time.perf_counter(), prompt, d.kv_transfer_params(), planned))
        for q in queues.values():
            await q.put(None)
        await asyncio.gather(*workers)
    return ttft


def replay_sim(window: list[TraceRequest], policy: str, measured: dict, kv_bytes: int, block_tokens: int,
               seed: int) -> list[float]:
    variant = next(v for v in variants() if v.name == policy)
    profile = replace(Profile(), name="measured tiny-Llama vLLM CPU engines", kv_bytes_per_token=kv_bytes,
                      block_tokens=block_tokens, gpu_kv_blocks=10_000, cpu_tier_blocks=10_000, max_running=1,
                      max_batched_tokens=8192, racks=1, nic_bytes_per_s=measured["pull_bytes_per_s"],
                      promotion_bytes_per_s=1e12, step_noise=0.05, engine_noise=0.02,
                      shared_machine=measured["contention"])
    ns = Namespace("sim", policy, "sim", CacheConfig(block_size=block_tokens)).validate()
    sim = Simulation(variant, window, BlockHashes(block_tokens), profile, len(NODES),
                     InProcessBackend(ns, RoutingSettings()), event_delay_ms=20.0, seed=seed, costs=measured["costs"])
    return asyncio.run(sim.run()).ttft_ms


def _default_trace() -> Path:
    """The project's shared trace, beside the checkout (``../shared/traces``)."""
    found = [d / "shared" / "traces" / "conversation_trace.jsonl" for d in Path(__file__).resolve().parents]
    return next((t for t in found if t.exists()), found[-1])


def main(argv: list[str]) -> int:
    known = [v.name for v in variants()]
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(_default_trace()), help="Mooncake-format JSONL trace")
    add_format_arguments(parser)
    parser.add_argument("--start", type=non_negative_int, default=0, help="the window's first request (from 0)")
    parser.add_argument("--requests", type=positive_int, default=36)
    parser.add_argument("--block-tokens", type=positive_int, default=2 * BLOCK_SIZE,
                        help="tokens per trace block (hash id) in the scaled window")
    parser.add_argument("--max-prompt", type=positive_int, default=2048)
    parser.add_argument("--max-tokens", type=positive_int, default=1, help="output tokens per request")
    parser.add_argument("--load", type=positive_float, default=0.7, help="arrival rate over the two engines' capacity")
    parser.add_argument("--policies", type=subset(known), default=list(POLICIES))
    parser.add_argument("--json", action="store_true")
    # all input, the whole trace included, checked before a model, a fleet or an engine starts (bad input:
    # run_command's one line, exit 2)
    args = parser.parse_args(argv)
    fmt = format_of(args)
    plan = select_windows(scan(Path(args.trace), fmt), args.start, 1, args.requests)
    started = time.monotonic()
    window = scaled_window(Path(args.trace), plan.starts[0], plan.requests, args.block_tokens, args.max_prompt,
                           args.max_tokens, fmt)
    policies = args.policies
    _, admin_key, _ = new_key()
    with tempfile.TemporaryDirectory(prefix="kvmesh-sim-to-real-") as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "model")
        spec = TinyLlamaSpec.from_checkpoint(model)
        shape = KVShape.from_checkpoint(model, dtype=DTYPE)
        kv_bytes = shape.bytes_per_token()
        block_bytes = kv_bytes * BLOCK_SIZE
        with Fleet(work / "fleet", 2, admin_key, tenant="simreal", block_bytes=block_bytes, block_tokens=BLOCK_SIZE,
                   capacity=f"{4096 * block_bytes}") as fleet:
            engines = {e: fleet.start_engine(e, model, node, max_model_len=args.max_prompt + 64)
                       for e, node in NODES.items()}
            for e in engines.values():
                e.wait_ready()
            measured = measure(fleet, engines, spec.vocab, kv_bytes, args.max_tokens)
            costs: FittedCosts = measured["costs"]
            service_ms = statistics.fmean(costs.prefill_alone_ms(r.input_tokens, 0, 8192) for r in window)
            span_ms = len(window) * service_ms / (len(NODES) * args.load)
            scale = max(1e-9, window[-1].arrival_ms) / span_ms
            window = [replace(r, arrival_ms=r.arrival_ms / scale) for r in window]
            measured["prefill_tokens_per_s"] = 2048 / (costs.prefill_alone_ms(2048, 0, 8192) / 1000.0)
            ns = Namespace("simreal", str(model), "random-init", CacheConfig(  # as the connector names its blocks
                block_size=BLOCK_SIZE, kv_dtype=shape.dtype, kv_layout=KV_LAYOUT, parallel_layout="tp1-pp1",
                hash_seed=os.environ.get("PYTHONHASHSEED", ""))).validate()
            # a discarded pass first, so that no measured policy runs on cold engines
            asyncio.run(replay_real(fleet, engines, ns, window, Prompts(spec.vocab, args.block_tokens, 0),
                                    policies[0], args.max_tokens, kv_bytes, measured))
            real = {}
            for salt, policy in enumerate(policies):
                real[policy] = asyncio.run(replay_real(fleet, engines, ns, window, Prompts(spec.vocab,
                                                       args.block_tokens, salt + 1), policy, args.max_tokens,
                                                       kv_bytes, measured))
    sim = {p: [x for seed in range(3) for x in replay_sim(window, p, measured, kv_bytes, args.block_tokens, seed)]
           for p in policies}
    rows = {p: {"sim_ttft_p50_ms": round(pct(sim[p], 0.5), 1), "real_ttft_p50_ms": round(pct(real[p], 0.5), 1),
                "sim_ttft_p90_ms": round(pct(sim[p], 0.9), 1), "real_ttft_p90_ms": round(pct(real[p], 0.9), 1)}
            for p in policies}
    for r in rows.values():
        r["p50_error"] = round(abs(r["sim_ttft_p50_ms"] - r["real_ttft_p50_ms"]) / max(1e-9, r["real_ttft_p50_ms"]), 3)
    result = {
        "policies": rows,
        "max_p50_error": max(r["p50_error"] for r in rows.values()),
        "rank_agreement": rank_agreement({p: r["real_ttft_p50_ms"] for p, r in rows.items()},
                                         {p: r["sim_ttft_p50_ms"] for p, r in rows.items()}),
        "profile": {**measured["costs"].as_dict(), "pull_ms_1024_tokens": round(measured["pull_ms_1024"], 2),
                    "pull_bytes_per_s": round(measured["pull_bytes_per_s"]),
                    "pulled_ms": [round(x, 2) for x in measured["pulled_ms"]],
                    "contention": round(measured["contention"], 3),
                    "calibration": [[n, round(ms, 2)] for n, ms in measured["samples"]],
                    "kv_bytes_per_token": kv_bytes},
        "window": {"start": args.start, "requests": len(window), "requests_requested": args.requests,
                   "trace_requests": plan.trace_requests, "note": plan.note, "block_tokens": args.block_tokens,
                   "load": args.load, "arrival_span_s": round(window[-1].arrival_ms / 1000.0, 2)},
        "wall_s": round(time.monotonic() - started, 1),
    }
    if plan.note:
        print(f"note: {plan.note}")
    print(f"{'policy':<18}{'sim p50 ms':>12}{'real p50 ms':>13}{'error':>8}{'sim p90':>10}{'real p90':>10}")
    for p, r in rows.items():
        print(f"{p:<18}{r['sim_ttft_p50_ms']:>12.1f}{r['real_ttft_p50_ms']:>13.1f}{100 * r['p50_error']:>7.0f}%"
              f"{r['sim_ttft_p90_ms']:>10.1f}{r['real_ttft_p90_ms']:>10.1f}")
    print(json.dumps(result) if args.json else f"rank agreement: {result['rank_agreement']}; wall {result['wall_s']} s")
    return 0
