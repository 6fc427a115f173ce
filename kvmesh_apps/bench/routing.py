"""``kvmesh bench routing [--json] [--quick] [--trace FILE]``: pull or recompute, decided on real engines over
shaped links (root: Linux network namespaces).

The fleet: Redis and the control plane in this namespace (on the switch's address), and per node ``nK`` a
network namespace holding its data plane and one vLLM CPU engine (a random-weight Llama built here, its KV
``kv_bytes_per_token`` in the report) with the kvmesh connector. Pulls cross the kernel's TCP stack between
namespaces (NIXL over UCX's TCP transport on the veths), shaped by ``tc``: an HTB class per destination on each
node's egress, so ``n1``-``n2`` is the fast pair (``--fast-mbit``) and every link to ``n3`` (and beyond) is slow
(``--slow-mbit``); ``--slow-delay-ms`` adds delay to the slow nodes (the kernel here has no netem:
:mod:`kvmesh_apps.netdelay`).

Calibration: every engine prefills prompts of several lengths alone (fitted: ms per token), all engines prefill
at once (their slow-down: they share the machine's cores), and every ordered pair pulls a 128- and a 1,024-token
prefix twice each after one discarded pull that pays the pair's first handshake (least squares: fixed ms and
bytes/s per link; a link whose slope is not positive falls back to its large pulls' mean rate and is named in
``setup.link_fit_fallback``). These are the figures the nodes report
(``ReportStats``, each node with its own key, links into itself only); during the replay each node reports
again what it measured (its engine's prefill rate on recomputes, its pulls' bytes over their seconds from the
engine's ``vllm:kvmesh_*`` counters), batched every ``--report-s`` (the router's lag), and the control plane
reads them back at most 1 s old. The threshold rule's ``min_cached_token_delta`` is the measured break-even on
the fleet's mean link (:func:`kvmesh_apps.replay.runs.threshold_tokens`).

The workload: conversation windows of the trace (Mooncake JSONL; :mod:`kvmesh_apps.bench.conversation_windows`:
whole conversations gathered from ``--horizon`` requests, so that follow-ups find their prefix on the engine that
served the previous turn; each trace block (``--trace-block-tokens``, 512 in Mooncake's traces) becomes
``--block-tokens`` token ids drawn from its hash id; requests longer than ``--max-prompt`` once scaled are left
out), arriving in the trace's order and relative gaps
at each ``--paces`` multiple of what the engines could prefill without any reuse; a follow-up is sent no earlier
than ``--think-ms`` after its previous turn's first token. Each engine serves one request at a time (the driver
queues; TTFT = queue + the engine's time for a 1-token request, any pull included). Policies:

- ``cost-aware``: cost-aware with P2P (the default policy);
- ``threshold``: affinity with llm-d's threshold rule at the measured break-even;
- ``never-pull``: cost-aware without P2P;
- ``always-pull``: load-aware, the threshold rule at 1 token (pull whatever a peer holds beyond the engine);
- ``token-aware``: token-aware without P2P.

Every repetition replays its own window at every pace with every policy, policies in a random order, each
run with token ids of its own (nothing cached carries over); a (pace, repetition) is one pair. Reported per
policy: TTFT p50/p90 and goodput (TTFT within ``--ttft-slo-ms`` of the prompt's prefill alone), the paired
differences against cost-aware with 95 % Student-t intervals, a decision audit (every pull's and every
recompute's estimated against measured TTFT; an oracle that knows where every prefix was served and the
measured fits, per request: pull from the best holder or recompute) and sim-to-real (the replay simulator set
up from the measured links and the prefill cost fitted on the runs' own recomputes replays every (pace, repetition): each policy's p50 and paired difference from
cost-aware, predicted against measured, the error over the repetitions, and the pairwise sign agreement of the
verdicts, a tie being its own verdict). The last line is one JSON object (docs/scheduling.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from control_plane.routing.config import RoutingSettings
from control_plane.routing.types import Candidate, EngineSample, LinkSample, Policy
from control_plane.scheduler_client import SchedulerClient
from kvmesh.command_line import Parser, UsageError, non_negative_float, positive_float, positive_int, \
    subset
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.bench.figures import interval, load_report, progress
from kvmesh_apps.bench.shaped_fleet import ShapedFleet
from kvmesh_apps.bench.conversation_windows import ConversationWindow, conversation_window
from kvmesh_apps.bench.sim_to_real import Prompts, paired_verdicts, sign_agreement
from kvmesh_apps.engine_host import BLOCK_SIZE, DTYPE, EngineProcess
from kvmesh_apps.kv_shape import KVShape
from kvmesh_apps.replay.backends import InProcessBackend
from kvmesh_apps.replay.costs import FittedCosts
from kvmesh_apps.replay.profile import Profile
from kvmesh_apps.replay.runs import pct, threshold_tokens
from kvmesh_apps.replay.sim import Simulation, Variant
from kvmesh_apps.replay.trace import BlockHashes, TraceRequest, add_format_arguments, format_of, scan, select_windows
from kvmesh_apps.tiny_model import TinyLlamaSpec, build_tiny_llama

PROG = "kvmesh bench routing"
TENANT = "routing"
MODEL = dict(num_layers=4, hidden=512, heads=8, kv_heads=4)   # 8 KiB of fp32 KV per token
CALIBRATION_LENGTHS = (64, 256, 512, 1024)
PULL_SIZES = (128, 1024)   # tokens of the calibration pulls on every ordered pair, ...
PULL_TRIES = 2             # ... each size this many times, after one discarded pull (the pair's first handshake)
CONTENTION_TOKENS = 512


@dataclass(frozen=True)
class PolicySpec:
    policy: Policy
    p2p: bool
    delta: str   # "break-even", "one" or "none" (the threshold rule's min_cached_token_delta)


POLICIES: dict[str, PolicySpec] = {
    "cost-aware": PolicySpec(Policy.COST_AWARE, True, "break-even"),
    "threshold": PolicySpec(Policy.AFFINITY, True, "break-even"),
    "never-pull": PolicySpec(Policy.COST_AWARE, False, "none"),
    "always-pull": PolicySpec(Policy.LOAD_AWARE, True, "one"),
    "token-aware": PolicySpec(Policy.TOKEN_AWARE, False, "none"),
}
BASELINE = "cost-aware"


def _default_trace() -> Path:
    found = [d / "shared" / "traces" / "conversation_trace.jsonl" for d in Path(__file__).resolve().parents]
    return next((t for t in found if t.exists()), found[-1])


# ---- the fleet -----------------------------------------------------------------------------------------------


# ---- measured figures ----------------------------------------------------------------------------------------


@dataclass
class Measured:
    costs: FittedCosts                                  # an engine alone: ms for a prompt (fitted)
    prefill_tokens_per_s: float
    link_fixed_ms: dict[tuple[str, str], float]         # (source, dest): a pull's fixed cost ...
    link_bytes_per_s: dict[tuple[str, str], float]      # ... and its rate
    samples: list = field(default_factory=list)
    contention: float = 0.0                             # a step's slow-down per other busy engine (reported)
    link_fallback: list = field(default_factory=list)   # links whose fit had no positive slope (mean rate used)
    pull_samples: dict = field(default_factory=dict)    # (source, dest): [(bytes, ms)] as the connector measured

    def recompute_ms(self, tokens: int, cached: int) -> float:
        return self.costs.step_ms(max(1, tokens - cached), [(max(1, tokens - cached), cached)], 0)

    def pull_ms(self, source: str, dest: str, tokens: int, kv_bytes: int) -> float:
        return self.link_fixed_ms[(source, dest)] + 1000.0 * tokens * kv_bytes / self.link_bytes_per_s[(source, dest)]


def _engine_ms(engine: EngineProcess, prompt: list[int], **kw) -> float:
    return 1000.0 * engine.generate(prompt, 1, **kw)["elapsed_s"]


def fit_link(pulls: list[tuple[float, float]]) -> tuple[float, float, bool]:
    """(bytes, ms) pulls of one link -> (fixed ms, bytes/s, fell back): the least-squares line through them; when
    its slope is not positive (the fixed cost's noise hides the bytes' time), the largest pulls' mean rate and no
    fixed cost."""
    x = np.array([[1.0, b] for b, _ in pulls])
    (fixed, per_byte_ms), *_ = np.linalg.lstsq(x, np.array([ms for _, ms in pulls]), rcond=None)
    if per_byte_ms > 0:
        return max(0.0, float(fixed)), 1000.0 / float(per_byte_ms), False
    largest = max(b for b, _ in pulls)
    top = [(b, ms) for b, ms in pulls if b == largest]
    return 0.0, 1000.0 * sum(b for b, _ in top) / sum(ms for _, ms in top), True


def measure(fleet: ShapedFleet, vocab: int, kv_bytes: int) -> Measured:
    """Each engine's prefill alone, fitted; the slow-down of all engines prefilling at once (they share the
    machine's cores); every ordered pair's pulls of two prefix sizes, each twice after a discarded first pull,
    fitted."""
    rng = np.random.default_rng(7)
    draw = lambda n: rng.integers(2, vocab, n).tolist()  # noqa: E731
    engines = list(fleet.engines.values())
    for e in engines:   # warm-up: the first requests of an engine are slow
        _engine_ms(e, draw(256), reset_prefix_cache=True)
    samples = [(n, statistics.median(_engine_ms(e, draw(n), reset_prefix_cache=True) for e in engines
                                     for _ in range(2))) for n in CALIBRATION_LENGTHS]
    costs = FittedCosts.fit(samples)
    alone = statistics.median(_engine_ms(engines[0], draw(CONTENTION_TOKENS), reset_prefix_cache=True)
                              for _ in range(2))
    with ThreadPoolExecutor(len(engines)) as pool:
        together = statistics.median(x for _ in range(2) for x in pool.map(
            lambda e: _engine_ms(e, draw(CONTENTION_TOKENS), reset_prefix_cache=True), engines))
    contention = max(0.0, (together / alone - 1.0) / max(1, len(engines) - 1))
    fixed, rate, fallback, pull_samples = {}, {}, [], {}
    for a in fleet.names:
        for b in fleet.names:
            if a == b:
                continue
            pulls = []   # (bytes, ms) as the connector measured them
            for k, n in enumerate([32] + [n for n in PULL_SIZES for _ in range(PULL_TRIES)]):
                prefix = draw(n)
                fleet.engines[a].generate(prefix, 1)        # its blocks go to a's CPU tier
                time.sleep(0.3)
                reply = fleet.engines[b].generate(prefix + draw(32), 1,
                                                  kv_transfer_params=fleet.source(a, f"cal-{a}{b}{k}"))
                kv = load_report(reply)
                if not kv.get("bytes_pulled"):
                    raise RuntimeError(f"calibration: {b} pulled nothing from {a}: {kv} (logs in {fleet.workdir})")
                if k:
                    pulls.append((kv["bytes_pulled"], kv["pull_ms"]))
            fixed[(a, b)], rate[(a, b)], fell_back = fit_link(pulls)
            pull_samples[(a, b)] = pulls
            if fell_back:
                fallback.append(f"{a}>{b}")
    tps = 1024 / (costs.prefill_alone_ms(1024, 0, 8192) / 1000.0)
    return Measured(costs, tps, fixed, rate, samples, contention, fallback, pull_samples)


class Reporter:
    """Each node's reports of what it measured, sent every ``period_s`` with its own key (the router's lag)."""

    def __init__(self, fleet: ShapedFleet, ns: Namespace, period_s: float) -> None:
        self.fleet, self.ns, self.period_s = fleet, ns, period_s
        self.links: dict[str, list[LinkSample]] = {n: [] for n in fleet.names}
        self.engines: dict[str, list[EngineSample]] = {n: [] for n in fleet.names}

    async def flush(self) -> None:
        for node in self.fleet.names:
            links, engines = self.links[node], self.engines[node]
            if not links and not engines:
                continue
            self.links[node], self.engines[node] = [], []
            async with SchedulerClient(self.fleet.cp.address, self.ns,
                                       api_key=self.fleet.key_files[node].read_text()) as client:
                await client.report_stats(links=links, engines=engines)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.period_s)
            except asyncio.TimeoutError:
                pass
            await self.flush()


# ---- one replay ------------------------------------------------------------------------------------------------


@dataclass
class Served:
    """One request as routed and as measured."""

    prompt: int
    engine: str
    source: str | None
    local: int              # tokens the engine's own tiers held, as routed
    routed_tokens: int      # tokens the source held, as routed (0: none)
    estimate_ms: float
    wait_ms: float = 0.0
    engine_ms: float = 0.0
    cached: int = 0
    pulled_bytes: float = 0.0   # moved by the engine's own pull (0 when it joined a route-time prefetch)
    peer_tokens: int = 0        # loaded after a pull from a peer (its own, or the prefetch it joined)
    outcome: str = ""           # the connector's load outcome ("pulled", "hit", "pull_missed", ...)
    prefetch: str = ""          # the route-time prefetch order's answer ("": none handed over)
    sent_ms: float = 0.0        # when the driver sent it, from the run's start (a follow-up: after its turn's reply)
    best_peer: tuple[str, int] | None = None   # (node, tokens) the oracle would pull from
    index: int = 0              # in the window

    @property
    def ttft_ms(self) -> float:
        return self.wait_ms + self.engine_ms

    @property
    def pulled(self) -> bool:
        """A source was routed and the engine loaded tokens from it."""
        return bool(self.source) and (self.peer_tokens > 0 or self.pulled_bytes > 0)


class Holdings:
    """Where each prefix was served (the oracle's knowledge): leading blocks per node."""

    def __init__(self) -> None:
        self.held: dict[str, set[tuple]] = {}

    def leading(self, node: str, prompt: list[int]) -> int:
        held = self.held.get(node, set())
        n = 0
        while (n + 1) * BLOCK_SIZE <= len(prompt) and tuple(prompt[: (n + 1) * BLOCK_SIZE]) in held:
            n += 1
        return n * BLOCK_SIZE

    def add(self, node: str, prompt: list[int]) -> None:
        held = self.held.setdefault(node, set())
        for n in range(1, len(prompt) // BLOCK_SIZE + 1):
            held.add(tuple(prompt[: n * BLOCK_SIZE]))


async def replay(fleet: ShapedFleet, ns: Namespace, window: list[TraceRequest], previous: list[int | None],
                 prompts: Prompts, name: str, delta: int, kv_bytes: int, reporter: Reporter, tag: str,
                 think_ms: float) -> list[Served]:
    """One run: request ``i`` is sent at its arrival, a follow-up (``previous[i]``) no earlier than ``think_ms``
    after its previous request's first token; routed by a real Route call, queued for its engine."""
    spec = POLICIES[name]
    replied = [asyncio.Event() for _ in window]
    queues = {e: asyncio.Queue() for e in fleet.names}
    backlog = {e: [0, 0] for e in fleet.names}
    holdings = Holdings()
    served: list[Served] = []

    async def serve(node: str) -> None:
        engine = fleet.engines[node]
        while (item := await queues[node].get()) is not None:
            arrived, prompt, params, planned, s = item
            started = time.perf_counter()
            backlog[node][0] -= 1
            reply = await asyncio.to_thread(engine.generate, prompt, 1, params)
            backlog[node][1] -= planned
            s.wait_ms, s.engine_ms = 1000.0 * (started - arrived), 1000.0 * reply["elapsed_s"]
            s.cached = reply["num_cached_tokens"]
            kv = load_report(reply)
            s.pulled_bytes, s.peer_tokens, s.outcome = kv.get("bytes_pulled", 0), kv.get("peer_tokens", 0), \
                kv.get("outcome", "")
            if s.source and s.pulled_bytes > 0 and kv.get("pull_ms", 0) > 0:   # what the node measured
                reporter.links[node].append(LinkSample(s.source, node, s.pulled_bytes / (kv["pull_ms"] / 1000.0)))
            elif len(prompt) - s.cached >= 64:
                reporter.engines[node].append(EngineSample(node, (len(prompt) - s.cached) / reply["elapsed_s"]))
            holdings.add(node, prompt)
            served.append(s)
            replied[s.index].set()

    async def send(client: SchedulerClient, i: int, r: TraceRequest, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + r.arrival_ms / 1000.0 - time.perf_counter()))
        if previous[i] is not None:
            await replied[previous[i]].wait()
            await asyncio.sleep(think_ms / 1000.0)
        sent = time.perf_counter()
        prompt = prompts.of(r, i)
        cands = [Candidate(e, e, backlog[e][0], backlog[e][1]) for e in fleet.names]
        d = await client.route(cands, token_ids=prompt, policy=spec.policy, p2p=spec.p2p,
                               min_cached_token_delta=delta, kv_bytes_per_token=kv_bytes, kv_request_id=f"{tag}-{i}")
        routed = d.source.cached_tokens if d.source else 0
        s = Served(len(prompt), d.engine_id, d.source.node_id if d.source else None, d.local_cached_tokens,
                   routed, d.estimate.ttft_ms, prefetch=d.prefetch_status, index=i, sent_ms=1000.0 * (sent - t0))
        peers = [(n, holdings.leading(n, prompt)) for n in fleet.names if n != d.engine_id]
        best = max(peers, key=lambda p: p[1])
        local = holdings.leading(d.engine_id, prompt)
        s.best_peer = best if best[1] > local else None
        planned = max(1, len(prompt) - max(routed, d.local_cached_tokens))
        backlog[d.engine_id][0] += 1
        backlog[d.engine_id][1] += planned
        await queues[d.engine_id].put((sent, prompt, d.kv_transfer_params(), planned, s))

    async with SchedulerClient(fleet.cp.address, ns, api_key=fleet.admin_key) as client:
        workers = [asyncio.create_task(serve(e)) for e in fleet.names]
        t0 = time.perf_counter()
        await asyncio.gather(*(send(client, i, r, t0) for i, r in enumerate(window)))
        for q in queues.values():
            await q.put(None)
        await asyncio.gather(*workers)
    return served


# ---- figures -------------------------------------------------------------------------------------------------


def summarize(served: list[Served], measured: Measured, slo_ms: float) -> dict:
    ttft = [s.ttft_ms for s in served]
    met = sum(s.ttft_ms <= slo_ms + measured.recompute_ms(s.prompt, 0) for s in served)
    return {"ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9), "met": met, "requests": len(served),
            "pulls": sum(s.pulled for s in served), "routed_pulls": sum(1 for s in served if s.source),
            "outcomes": dict(Counter(f"{s.outcome or 'none'}/{s.prefetch or 'no-order'}" for s in served
                                     if s.source))}


def audit(runs: dict[str, list[list[Served]]], measured: Measured, kv_bytes: int) -> dict:
    """Estimated against measured TTFT for every pull and every recompute; the oracle's disagreements."""
    pull_err, recompute_err, pull_ms, recompute_ms = [], [], [], []
    disagree, decided = 0, 0
    for name, reps in runs.items():
        for served in reps:
            for s in served:
                error = (s.estimate_ms - s.ttft_ms) / max(1e-9, s.ttft_ms)
                if s.pulled:
                    pull_err.append(error)
                    pull_ms.append(s.estimate_ms - s.ttft_ms)
                else:
                    recompute_err.append(error)
                    recompute_ms.append(s.estimate_ms - s.ttft_ms)
                if s.best_peer is None or not POLICIES[name].p2p:
                    continue
                node, tokens = s.best_peer
                local = min(s.local, tokens)
                pull = measured.pull_ms(node, s.engine, tokens - local, kv_bytes) + measured.recompute_ms(
                    s.prompt, tokens)
                stay = measured.recompute_ms(s.prompt, local)
                decided += 1
                disagree += (pull < stay) != bool(s.source)
    return {"pull_error_p50": round(pct(pull_err, 0.5), 3) if pull_err else None,
            "recompute_error_p50": round(pct(recompute_err, 0.5), 3) if recompute_err else None,
            "oracle_disagreements": disagree, "oracle_decisions": decided,
            "pulls": len(pull_err), "recomputes": len(recompute_err),
            "pull_error_ms_p10_p50_p90": [round(pct(pull_ms, q), 1) for q in (0.1, 0.5, 0.9)] if pull_ms else None,
            "recompute_error_ms_p10_p50_p90": [round(pct(recompute_ms, q), 1) for q in (0.1, 0.5, 0.9)]
            if recompute_ms else None,
            "error": "(estimated - measured) / measured TTFT; the oracle: measured fits, pull from the best holder "
                     "or recompute, per request"}


def as_sent(window: list[TraceRequest], served: list[Served]) -> list[TraceRequest]:
    """The window as a run sent it (a follow-up waited for its previous turn's reply): what the simulator replays."""
    return sorted((dataclasses.replace(window[s.index], arrival_ms=s.sent_ms) for s in served),
                  key=lambda r: r.arrival_ms)


def served_costs(runs: dict[tuple, list[Served]]) -> FittedCosts:
    """The engines' prefill cost as the replays measured it: a line through every request that pulled nothing
    (tokens it computed, its time in the engine), all policies and paces pooled; the machine's contention, as
    the runs met it, is in it."""
    points = [(s.prompt - s.cached, s.engine_ms) for served in runs.values() for s in served if not s.pulled]
    x = np.array([[1.0, n] for n, _ in points])
    (fixed, per_token), *_ = np.linalg.lstsq(x, np.array([ms for _, ms in points]), rcond=None)
    return FittedCosts(max(0.0, float(fixed)), max(1e-6, float(per_token)), 0.0)


def simulate(window: list[TraceRequest], name: str, measured: Measured, costs: FittedCosts, kv_bytes: int,
             nodes: int, block_tokens: int, delta: int, seed: int, report_s: float) -> list[float]:
    """The replay simulator on the measured figures: the links' fits, ``costs`` (:func:`served_costs`: the
    contention the runs met is in them, so no more is added); one request at a time per engine, as the harness
    serves; no probes (the harness has none: the router learns links from pulls); engine reports every
    ``report_s``; queues as the gateway counts them."""
    spec = POLICIES[name]
    fast = measured.link_bytes_per_s[("n1", "n2")]
    slow = statistics.median(v for k, v in measured.link_bytes_per_s.items() if "n3" in k) if nodes > 2 else fast
    fixed = statistics.median(measured.link_fixed_ms.values())
    profile = dataclasses.replace(Profile(), name="measured tiny-Llama vLLM CPU engines", kv_bytes_per_token=kv_bytes,
                                  block_tokens=block_tokens, gpu_kv_blocks=100_000, cpu_tier_blocks=100_000,
                                  max_running=1, max_batched_tokens=8192, racks=2 if nodes > 2 else 1,
                                  nic_bytes_per_s=fast, inter_rack_bytes_per_s=slow, promotion_bytes_per_s=1e12,
                                  lookup_ms=fixed, step_noise=0.05, engine_noise=0.02,
                                  reprobe_s=0.0, report_s=report_s,
                                  load_report_ms=50.0)
    ns = Namespace("sim", name, "sim", CacheConfig(block_size=block_tokens)).validate()
    settings = RoutingSettings(route_min_cached_token_delta=delta or 1)
    sim = Simulation(Variant(name, spec.policy, spec.p2p), window, BlockHashes(block_tokens), profile, nodes,
                     InProcessBackend(ns, settings), event_delay_ms=50.0, seed=seed, costs=costs)
    return asyncio.run(sim.run()).ttft_ms


# ---- the command ---------------------------------------------------------------------------------------------


def _parser() -> Parser:
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(_default_trace()), help="Mooncake-format JSONL trace")
    add_format_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="3 nodes, 1 pace, 2 repetitions, short windows")
    parser.add_argument("--nodes", type=positive_int, default=3, help="nodes (each a namespace, a data plane, an engine)")
    parser.add_argument("--requests", type=positive_int, default=40, help="requests per window")
    parser.add_argument("--horizon", type=positive_int, default=2000,
                        help="trace requests scanned for each window's conversations")
    parser.add_argument("--repetitions", type=positive_int, default=6)
    parser.add_argument("--paces", type=lambda t: [positive_float(x) for x in t.split(",")], default=[1.0, 2.0],
                        help="arrival rates as multiples of what the engines could prefill without reuse")
    parser.add_argument("--policies", type=subset(list(POLICIES)), default=list(POLICIES))
    parser.add_argument("--block-tokens", type=positive_int, default=BLOCK_SIZE, help="tokens per trace block")
    parser.add_argument("--max-prompt", type=positive_int, default=1024)
    parser.add_argument("--fast-mbit", type=positive_float, default=800.0, help="n1-n2 link rate")
    parser.add_argument("--slow-mbit", type=positive_float, default=80.0, help="every other link's rate")
    parser.add_argument("--slow-delay-ms", type=non_negative_float, default=0.0,
                        help="delay on the slow nodes' links (netdelay)")
    parser.add_argument("--think-ms", type=non_negative_float, default=250.0,
                        help="a follow-up is sent no earlier than this after its previous turn's first token")
    parser.add_argument("--report-s", type=positive_float, default=1.0, help="how often nodes report (the lag)")
    parser.add_argument("--ttft-slo-ms", type=non_negative_float, default=1000.0,
                        help="goodput: TTFT within this of the prompt's prefill alone")
    parser.add_argument("--seed", type=int, default=0, help="the policies' order and the windows")
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)  # bad input (UsageError, TraceError) is run_command's one line, exit 2
    if args.quick:
        args.repetitions, args.paces, args.requests = 2, args.paces[-1:], min(args.requests, 10)
    if args.nodes < 2:
        raise UsageError("--nodes: at least 2")
    if os.geteuid() != 0:
        raise UsageError("network namespaces need root: run it as root")
    fmt = format_of(args)
    info = scan(Path(args.trace), fmt)   # every window its own stretch of the trace: as many as --repetitions
    horizon = max(1, min(args.horizon, info.requests // args.repetitions))
    plan = select_windows(info, 0, args.repetitions, horizon, spacing=horizon)
    windows = [conversation_window(Path(args.trace), start, plan.requests, args.requests, args.block_tokens,
                                   args.max_prompt, fmt) for start in plan.starts]
    started = time.monotonic()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvmesh-routing-") as tmp:
        work = Path(tmp)
        model = build_tiny_llama(work / "model", **MODEL)
        spec = TinyLlamaSpec.from_checkpoint(model)
        shape = KVShape.from_checkpoint(model, dtype=DTYPE)
        kv_bytes = shape.bytes_per_token()
        fleet = ShapedFleet(work, args.nodes, lambda a, b: args.fast_mbit if {a, b} == {"n1", "n2"} else args.slow_mbit,
                            args.max_prompt + 64, kv_bytes * BLOCK_SIZE, tenant=TENANT,
                            delay_ms={f"n{i + 1}": args.slow_delay_ms for i in range(2, args.nodes)})
        try:
            fleet.start(model)
            runs, spans, scaled, measured, deltas = asyncio.run(_bench(fleet, args, windows, spec.vocab, kv_bytes,
                                                                       shape, model, rng))
        finally:
            fleet.stop()
    result = report(runs, spans, scaled, measured, args, kv_bytes, deltas, args.nodes)
    result["setup"]["windows"] = {"trace_starts": list(plan.starts), "horizon": plan.requests,
                                  "follow_ups": [w.follow_ups for w in windows],
                                  "shared_tokens": [w.shared_tokens for w in windows], "note": plan.note}
    result["wall_s"] = round(time.monotonic() - started, 1)
    _print(result)
    print(json.dumps(result) if args.json else f"wall {result['wall_s']} s")
    return 0


async def _bench(fleet: ShapedFleet, args, conversations: list[ConversationWindow], vocab: int, kv_bytes: int,
                 shape: KVShape, model: Path, rng: random.Random) -> tuple:
    say = progress(args.json)
    measured = await asyncio.to_thread(measure, fleet, vocab, kv_bytes)
    say(f"calibrated: {measured.prefill_tokens_per_s:.0f} tokens/s, contention {measured.contention:.2f}, links "
        + ", ".join(f"{a}>{b} {v / 1e6:.1f} MB/s +{measured.link_fixed_ms[(a, b)]:.0f} ms"
                    for (a, b), v in measured.link_bytes_per_s.items()))
    ns = fleet.namespace(model, shape)
    reporter = Reporter(fleet, ns, args.report_s)
    for (a, b), bps in measured.link_bytes_per_s.items():
        reporter.links[b].append(LinkSample(a, b, bps))
    for node in fleet.names:
        reporter.engines[node].append(EngineSample(node, measured.prefill_tokens_per_s))
    await reporter.flush()
    links = list(measured.link_bytes_per_s.values())
    fixed = statistics.median(measured.link_fixed_ms.values())
    delta = threshold_tokens(kv_bytes, measured.prefill_tokens_per_s, links, 1e12, fixed)
    deltas = {"break-even": min(delta, args.max_prompt * 4), "one": 1, "none": 0}
    windows = [w.requests for w in conversations]
    previous = [w.previous for w in conversations]
    service_ms = statistics.fmean(measured.recompute_ms(r.input_tokens, 0) for w in windows for r in w)
    stop = asyncio.Event()
    reporting = asyncio.create_task(reporter.run(stop))
    runs: dict[tuple, list[Served]] = {}
    spans: dict[tuple, float] = {}
    scaled: dict[tuple, list[TraceRequest]] = {}
    salt = 0
    try:
        for rep, window in enumerate(windows):
            for pace in args.paces:
                span_ms = len(window) * service_ms / (len(fleet.names) * pace)
                scale = max(1e-9, window[-1].arrival_ms) / span_ms
                timed = [dataclasses.replace(r, arrival_ms=r.arrival_ms / scale) for r in window]
                scaled[(pace, rep)] = timed
                order = list(args.policies)
                rng.shuffle(order)
                for name in order:
                    salt += 1
                    t0 = time.perf_counter()
                    runs[(name, pace, rep)] = await replay(
                        fleet, ns, timed, previous[rep], Prompts(vocab, args.block_tokens, salt), name,
                        deltas[POLICIES[name].delta], kv_bytes, reporter, f"{name}-{pace}-{rep}", args.think_ms)
                    spans[(name, pace, rep)] = time.perf_counter() - t0
                    done = runs[(name, pace, rep)]
                    say(f"window {rep} pace {pace} {name}: p50 {pct([x.ttft_ms for x in done], 0.5):.0f} ms, "
                        f"{sum(x.pulled for x in done)} pulls ({sum(1 for x in done if x.source)} routed), "
                        f"{spans[(name, pace, rep)]:.0f} s")
    finally:
        stop.set()
        await reporting
    return runs, spans, scaled, measured, deltas


def report(runs, spans, scaled, measured: Measured, args, kv_bytes: int, deltas: dict, nodes: int) -> dict:
    """The issue's JSON object (and the details behind it) from the runs; the simulations run here."""
    names, units = list(args.policies), sorted({(p, r) for _, p, r in runs})
    per = {k: summarize(v, measured, args.ttft_slo_ms) for k, v in runs.items()}
    for k, r in per.items():
        r["goodput_rps"] = r["met"] / max(1e-9, spans[k])
    policies = {}
    for n in names:
        rows = [per[(n, p, r)] for p, r in units]
        policies[n] = {"ttft_p50_ms": round(statistics.fmean(x["ttft_p50_ms"] for x in rows), 1),
                       "ttft_p90_ms": round(statistics.fmean(x["ttft_p90_ms"] for x in rows), 1),
                       "goodput_rps": round(statistics.fmean(x["goodput_rps"] for x in rows), 3),
                       "pulls": sum(x["pulls"] for x in rows),
                       "routed_pulls": sum(x["routed_pulls"] for x in rows),
                       "routed_pull_outcomes": dict(sum((Counter(x["outcomes"]) for x in rows), Counter()))}
    paired = {}
    for n in names:
        if n == BASELINE or BASELINE not in names:
            continue
        d50, ci50 = interval([per[(n, p, r)]["ttft_p50_ms"] - per[(BASELINE, p, r)]["ttft_p50_ms"] for p, r in units])
        d90, ci90 = interval([per[(n, p, r)]["ttft_p90_ms"] - per[(BASELINE, p, r)]["ttft_p90_ms"] for p, r in units])
        dg, cig = interval([per[(n, p, r)]["goodput_rps"] - per[(BASELINE, p, r)]["goodput_rps"] for p, r in units], 3)
        paired[n] = {"delta_p50_ms": d50, "ci95_p50_ms": ci50, "delta_p90_ms": d90, "ci95_p90_ms": ci90,
                     "delta_goodput_rps": dg, "ci95_goodput_rps": cig}
    by_pace = {str(p): {n: {"ttft_p50_ms": round(statistics.fmean(per[(n, p, r)]["ttft_p50_ms"]
                                                                   for q, r in units if q == p), 1)}
                        for n in names} for p in args.paces}
    grouped = {n: [runs[(n, p, r)] for p, r in units] for n in names}
    costs = served_costs(runs)
    sim_units = {n: [pct(simulate(as_sent(scaled[(p, r)], runs[(n, p, r)]), n, measured, costs, kv_bytes, nodes,
                                  args.block_tokens, deltas[POLICIES[n].delta], r, args.report_s), 0.5)
                      for p, r in units] for n in names}
    real_units = {n: [per[(n, p, r)]["ttft_p50_ms"] for p, r in units] for n in names}
    return {
        "policies": policies,
        "paired_vs_cost_aware": paired,
        "repetitions": len({r for _, r in units}),
        "decision_audit": audit(grouped, measured, kv_bytes),
        "sim_to_real": {**sim_to_real(real_units, sim_units), "prefill_fit_from_runs": costs.as_dict()},
        "by_pace": by_pace,
        "setup": {"nodes": nodes, "paces": args.paces, "requests_per_window": len(next(iter(runs.values()))),
                  "kv_bytes_per_token": kv_bytes, "block_tokens": args.block_tokens, "max_prompt": args.max_prompt,
                  "fast_mbit": args.fast_mbit, "slow_mbit": args.slow_mbit, "slow_delay_ms": args.slow_delay_ms,
                  "min_cached_token_delta": deltas["break-even"], "trace": args.trace,
                  "prefill_tokens_per_s": round(measured.prefill_tokens_per_s),
                  "calibration_ms": [[n, round(ms, 1)] for n, ms in measured.samples],
                  "link_bytes_per_s": {f"{a}>{b}": round(v) for (a, b), v in measured.link_bytes_per_s.items()},
                  "link_fixed_ms": {f"{a}>{b}": round(v, 1) for (a, b), v in measured.link_fixed_ms.items()},
                  "link_fit_fallback": measured.link_fallback, "contention": round(measured.contention, 3),
                  "calibration_pulls_bytes_ms": {f"{a}>{b}": [[int(x), round(ms, 1)] for x, ms in v]
                                                 for (a, b), v in measured.pull_samples.items()},
                  "ttft_slo_ms": args.ttft_slo_ms, "report_s": args.report_s, "think_ms": args.think_ms},
    }


def sim_to_real(real_units: dict[str, list[float]], sim_units: dict[str, list[float]]) -> dict:
    """The simulator's per-unit (pace, repetition) p50s against the real ones: each policy's p50 and its paired
    difference from cost-aware, predicted and measured (with their 95 % intervals), the error over the units, and
    the pairwise sign agreement of the verdicts (a tie, a paired interval holding 0, is its own verdict)."""
    names = list(real_units)
    real_p50 = {n: statistics.fmean(v) for n, v in real_units.items()}
    sim_p50 = {n: statistics.fmean(v) for n, v in sim_units.items()}
    errors = {n: [abs(s - r) / max(1e-9, r) for s, r in zip(sim_units[n], real_units[n])] for n in names}
    real_v, sim_v = paired_verdicts(real_units), paired_verdicts(sim_units)
    paired = {}
    for n in names:
        if n == BASELINE or BASELINE not in names:
            continue
        real_d = [x - y for x, y in zip(real_units[n], real_units[BASELINE])]
        sim_d = [x - y for x, y in zip(sim_units[n], sim_units[BASELINE])]
        rd, rci = interval(real_d)
        sd, sci = interval(sim_d)
        paired[n] = {"real_delta_p50_ms": rd, "real_ci95": rci, "sim_delta_p50_ms": sd, "sim_ci95": sci,
                     "real_ci_holds_sim": None if rci is None else rci[0] <= sd <= rci[1],
                     "delta_error_ms_p50": round(pct([abs(s - r) for s, r in zip(sim_d, real_d)], 0.5), 1)}
    return {"rank_agreement": sign_agreement(real_v, sim_v),
            "max_p50_error": round(max(abs(sim_p50[n] - real_p50[n]) / max(1e-9, real_p50[n]) for n in names), 3),
            "sim_ttft_p50_ms": {n: round(v, 1) for n, v in sim_p50.items()},
            "p50_error_over_repetitions": {n: {"p50": round(pct(e, 0.5), 3), "max": round(max(e), 3)}
                                           for n, e in errors.items()},
            "paired_vs_cost_aware": paired,
            "verdicts": {f"{a} vs {b}": [real_v[(a, b)], sim_v[(a, b)]] for a, b in real_v},
            "method": "per (pace, repetition): the simulator on the measured links and the runs' prefill fit "
                      "replays the window as that policy's run sent it; verdicts [real, sim]: -1 the first policy faster, 1 slower, 0 a tie (the 95 % "
                      "paired interval over the units holds 0); rank_agreement: the fraction of pairs alike"}


def _print(result: dict) -> None:
    print(f"{'policy':<14}{'p50 ms':>9}{'p90 ms':>9}{'good/s':>8}{'pulls':>7}{'routed':>7}"
          f"{'Δp50 vs cost-aware (95%)':>34}")
    for n, r in result["policies"].items():
        d = result["paired_vs_cost_aware"].get(n)
        delta = f"{d['delta_p50_ms']:+.1f} {d['ci95_p50_ms']}" if d else "-"
        print(f"{n:<14}{r['ttft_p50_ms']:>9.1f}{r['ttft_p90_ms']:>9.1f}{r['goodput_rps']:>8.2f}{r['pulls']:>7}"
              f"{r['routed_pulls']:>7}{delta:>34}")
    print(f"decision audit: {json.dumps(result['decision_audit'])}")
    print(f"sim-to-real: {json.dumps(result['sim_to_real'])}")
