"""``kvmesh demo``: a local fleet with two vLLM engines that pull prompt prefixes from each other.

It starts a :class:`kvmesh_apps.fleet.Fleet` on embedded defaults (embedded Redis, the control
plane, two data-plane nodes, loopback, no Docker, every gRPC link mutual TLS with the fleet's
own CA, as ``kvmesh up`` runs it) and two vLLM CPU engines, one per node, on
a random-weight Llama built locally (vLLM's own prefix cache off, so every reused token comes
through kvmesh). Then it plays a router: multi-turn sessions on a shared
system prompt, each turn sent to the *other* engine than the previous one. Before each
request the router asks the control plane (``LookupPrefix``) who holds the longest prefix of
the prompt and names that node in ``kv_transfer_params.remote_kv_source``; the engine's
connector has its data plane pull the blocks over NIXL and loads them. Every pulled request
is run again on a cold cache with loads off, to compare TTFT and what the engine computed:
the generated tokens and their top-5 logprobs must agree within
:data:`kvmesh_apps.kv_check.LOGPROB_TOLERANCE` (``outputs_match``, ``max_logprob_diff``).

``--check`` adds the negative control: a third engine whose connector loads one block per
request from the wrong slot (``misplace_one_block``) runs the last pulled prompt; the same
comparison must fail (``negative_control_failed``), else the check itself proves nothing and
the demo exits non-zero.

The report: prefix tokens pulled vs recomputed, hit rate by tier, bytes moved, lookup and pull
latency, TTFT with pull vs with recompute. ``--json`` ends with one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.command_line import Parser, positive_int, run_command
from kvmesh.channels import channel
from kvmesh_apps.engine_host import DTYPE
from kvmesh_apps.fleet import Fleet
from kvmesh_apps.kv_check import LOGPROB_TOLERANCE, same_computation
from kvmesh_apps.kv_shape import KVShape
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.tiny_model import DEMO_PRESET, TEST_INIT_STD, TinyLlamaSpec, build_tiny_llama
from kvmesh.v1 import common_pb2, control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from tenancy.api_keys import new_key

BLOCK_SIZE = 32
TENANT = "demo"
MODEL_NAME = "demo-llama"
WEIGHT_VERSION = "random-init"
MODELS: dict[str, dict[str, Any]] = {"demo": DEMO_PRESET, "tiny": {"init_std": TEST_INIT_STD}}
INDEX_WAIT_S = 3.0
TOP_K = 5


@dataclass
class Turn:
    """One request of the scenario and what happened to it."""

    session: int
    turn: int
    engine: str
    prompt_tokens: int
    held_tokens: int = 0  # longest prefix in some node's CPU tier when routed
    source: str = ""
    loaded_tokens: int = 0
    peer_tokens: int = 0
    local_tokens: int = 0
    engine_cached_tokens: int = 0  # vLLM's own prefix cache (off in the demo: stays 0)
    computed_tokens: int = 0
    bytes_pulled: int = 0
    cp_lookup_ms: float = 0.0
    pull_ms: float = 0.0
    peer_lookup_ms: float = 0.0
    transfer_ms: float = 0.0
    ttft_ms: float = 0.0
    recompute_ttft_ms: float | None = None
    output_matches: bool | None = None
    logprob_diff: float | None = None


class Progress:
    """A one-line elapsed-time display on stderr while something slow runs."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.monotonic()

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        end = "\n" if sys.stderr.isatty() else ""
        print(f"\r  {self._label}: done in {time.monotonic() - self._started:.0f} s   ", file=sys.stderr, end=end,
              flush=True)
        if not sys.stderr.isatty():
            print(file=sys.stderr, flush=True)

    def _run(self) -> None:
        tty = sys.stderr.isatty()
        spinner = "|/-\\"
        tick = 0
        while not self._stop.wait(1.0 if tty else 10.0):
            elapsed = time.monotonic() - self._started
            if tty:
                print(f"\r  {self._label} {spinner[tick % 4]} {elapsed:.0f} s", file=sys.stderr, end="", flush=True)
            else:
                print(f"  {self._label} ... {elapsed:.0f} s", file=sys.stderr, flush=True)
            tick += 1


def namespace() -> Namespace:
    """The namespace the engines' connectors derive (config.py) for this demo's settings."""
    from engine_connector.config import KV_LAYOUT

    return Namespace(TENANT, MODEL_NAME, WEIGHT_VERSION, CacheConfig(
        block_size=BLOCK_SIZE, kv_dtype="float32", kv_layout=KV_LAYOUT, parallel_layout="tp1-pp1")).validate()


class Router:
    """Asks the control plane who holds a prompt's prefix (CPU tiers); waits for the index to catch up."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._ns = namespace().to_proto()

    async def _holders(self, prompt: list[int]) -> tuple[dict[str, int], float]:
        async with channel(self._fleet.control_plane.address, self._fleet.admin_key,
                           self._fleet.control_plane_tls()) as ch:
            started = time.perf_counter()
            reply = await cp_grpc.ControlPlaneStub(ch).LookupPrefix(cp_pb.LookupPrefixRequest(
                namespace=self._ns, token_ids=prompt, media=[common_pb2.MEDIUM_CPU]), timeout=5)
            ms = (time.perf_counter() - started) * 1e3
        return {h.node_id: h.leading_blocks for h in reply.holders}, ms

    def holders(self, prompt: list[int]) -> tuple[dict[str, int], float]:
        return asyncio.run(self._holders(prompt))

    def wait_indexed(self, prompt: list[int], node: str, blocks: int) -> None:
        """Until the control plane shows ``node`` holding ``blocks`` leading blocks (events are asynchronous)."""
        deadline = time.monotonic() + INDEX_WAIT_S
        while time.monotonic() < deadline and self.holders(prompt)[0].get(node, 0) < blocks:
            time.sleep(0.05)

    def source(self, prompt: list[int], node: str) -> tuple[dict[str, Any] | None, int, float]:
        """``remote_kv_source`` for an engine on ``node`` (None: no peer is ahead), tokens held, lookup ms."""
        holders, ms = self.holders(prompt)
        usable = (len(prompt) - 1) // BLOCK_SIZE
        best = max(holders.items(), key=lambda kv: kv[1], default=("", 0))
        held = min(best[1], usable) * BLOCK_SIZE
        if not best[0] or best[0] == node or best[1] <= holders.get(node, 0):
            return None, held, ms
        host, port = self._fleet.data_planes[best[0]].address.rsplit(":", 1)
        return ({"kv_request_id": f"demo-{time.monotonic_ns()}", "remote_host": host, "remote_port": int(port),
                 "remote_node_id": best[0]}, held, ms)


def _p50(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else 0.0


def run_scenario(fleet: Fleet, engines: dict[str, Any], args: argparse.Namespace, vocab: int,
                 say) -> tuple[list[Turn], bool, dict[str, Any]]:
    """The turns, whether every pulled one matched its recompute, and the last pulled one's prompt and
    recompute (for the negative control)."""
    rng = np.random.default_rng(args.seed)
    draw = lambda n: rng.integers(2, vocab, n).tolist()  # noqa: E731
    system_prompt = draw(args.prefix_tokens)
    histories = {s: list(system_prompt) for s in range(args.sessions)}
    nodes = {"a": "dp1", "b": "dp2"}
    router = Router(fleet)
    turns: list[Turn] = []
    last_pulled: dict[str, Any] = {}
    say(f"\n {'#':>2} {'session':>7} {'turn':>4} {'engine':>6} {'prompt':>6} {'pulled':>6} {'local':>6} "
        f"{'cached':>6} {'computed':>8} {'TTFT ms':>8} {'recompute':>9}  source")
    for turn_index in range(args.turns):
        for session in range(args.sessions):
            engine_name = "ab"[(session + turn_index) % 2]
            prompt = histories[session] + draw(args.user_tokens)
            source, held, cp_ms = router.source(prompt, nodes[engine_name])
            params = {"remote_kv_source": source} if source else {}
            out = engines[engine_name].generate(prompt, args.max_tokens, params, logprobs=TOP_K)
            report = out["kv_transfer_params"]["kvmesh"]
            turn = Turn(session, turn_index + 1, engine_name, len(prompt), held_tokens=held,
                        source=report["source"], loaded_tokens=report["loaded_tokens"],
                        peer_tokens=report["peer_tokens"], local_tokens=report["local_tokens"],
                        engine_cached_tokens=out["num_cached_tokens"] - report["loaded_tokens"],
                        bytes_pulled=report["bytes_pulled"], cp_lookup_ms=cp_ms, pull_ms=report["pull_ms"],
                        peer_lookup_ms=report["peer_lookup_ms"], transfer_ms=report["transfer_ms"],
                        ttft_ms=out["ttft_s"] * 1e3)
            turn.computed_tokens = len(prompt) - out["num_cached_tokens"]
            if turn.peer_tokens:
                cold = engines[engine_name].generate(prompt, args.max_tokens, {"kvmesh": {"load": False, "save": False}},
                                                     reset_prefix_cache=True, logprobs=TOP_K)
                turn.recompute_ttft_ms = cold["ttft_s"] * 1e3
                turn.output_matches, turn.logprob_diff = same_computation(out, cold)
                last_pulled = {"prompt": prompt, "recompute": cold, "source": source}
            turns.append(turn)
            recompute = f"{turn.recompute_ttft_ms:9.0f}" if turn.recompute_ttft_ms is not None else f"{'':9}"
            say(f" {len(turns):>2} {session:>7} {turn.turn:>4} {engine_name:>6} {turn.prompt_tokens:>6} "
                f"{turn.peer_tokens:>6} {turn.local_tokens:>6} {turn.engine_cached_tokens:>6} "
                f"{turn.computed_tokens:>8} {turn.ttft_ms:>8.0f} {recompute}  {turn.source or '-'}")
            histories[session] = prompt + out["token_ids"]
            router.wait_indexed(histories[session], nodes[engine_name], report["stored_blocks"])
    return turns, all(t.output_matches for t in turns if t.output_matches is not None), last_pulled


def negative_control(fleet: Fleet, model: Path, connector: dict[str, Any], last_pulled: dict[str, Any],
                     args: argparse.Namespace) -> dict[str, Any]:
    """The last pulled prompt on an engine that misplaces one loaded block: the comparison must fail."""
    engine = fleet.start_engine("misplaced", model, "dp2", connector={**connector, "misplace_one_block": True},
                                max_model_len=4096, enable_prefix_caching=False).wait_ready()
    out = engine.generate(last_pulled["prompt"], args.max_tokens,
                          {"remote_kv_source": last_pulled["source"]}, logprobs=TOP_K)
    fleet.stop_engine("misplaced")
    same, diff = same_computation(out, last_pulled["recompute"])
    loaded = out["kv_transfer_params"]["kvmesh"]["loaded_tokens"]
    return {"negative_control_failed": bool(loaded) and not same, "negative_control_logprob_diff": diff,
            "negative_control_loaded_tokens": loaded}


def summarize(turns: list[Turn], outputs_match: bool, block_bytes: int) -> dict[str, Any]:
    diffs = [t.logprob_diff for t in turns if t.logprob_diff is not None]
    # Prefix tokens: what the fleet's CPU tiers held of each prompt when it was routed (the usable part),
    # less what the engine's own prefix cache had (vLLM asks the connector only beyond that; 0 here).
    prefix = sum(max(0, t.held_tokens - t.engine_cached_tokens) for t in turns)
    loaded = sum(t.loaded_tokens for t in turns)
    pulled = [t for t in turns if t.peer_tokens]
    return {
        "prefix_tokens": prefix,
        "external_hit_rate": round(loaded / prefix, 4) if prefix else 0.0,
        "hit_rate_by_tier": {
            "peer_cpu": round(sum(t.peer_tokens for t in turns) / prefix, 4) if prefix else 0.0,
            "local_cpu": round(sum(t.local_tokens for t in turns) / prefix, 4) if prefix else 0.0,
        },
        "tokens_pulled": sum(t.peer_tokens for t in turns),
        "tokens_loaded_local": sum(t.local_tokens for t in turns),
        "tokens_engine_cache": sum(t.engine_cached_tokens for t in turns),
        "tokens_recomputed": sum(t.computed_tokens for t in turns),
        "prefix_tokens_recomputed": max(0, prefix - loaded),
        "bytes_pulled": sum(t.bytes_pulled for t in turns),
        "block_bytes": block_bytes,
        "lookup_p50_ms": _p50([t.cp_lookup_ms for t in turns]),
        "peer_lookup_p50_ms": _p50([t.peer_lookup_ms for t in pulled]),
        "pull_p50_ms": _p50([t.pull_ms for t in pulled]),
        "transfer_p50_ms": _p50([t.transfer_ms for t in pulled]),
        "ttft_pull_ms": _p50([t.ttft_ms for t in pulled]),
        "ttft_recompute_ms": _p50([t.recompute_ttft_ms for t in pulled if t.recompute_ttft_ms is not None]),
        "outputs_match": outputs_match,
        "max_logprob_diff": max(diffs) if diffs else None,
        "logprob_tolerance": LOGPROB_TOLERANCE,
        "requests": len(turns),
        "requests_pulled": len(pulled),
        "turns": [asdict(t) for t in turns],
    }


def _print_summary(result: dict[str, Any], say) -> None:
    mib = result["bytes_pulled"] / 2**20
    ratio = result["ttft_pull_ms"] / result["ttft_recompute_ms"] if result["ttft_recompute_ms"] else 0.0
    say("")
    say(f"  prefix tokens held in the fleet   {result['prefix_tokens']:>8,}")
    say(f"    pulled from a peer              {result['tokens_pulled']:>8,}  ({result['hit_rate_by_tier']['peer_cpu']:.0%})")
    say(f"    loaded from the local CPU tier  {result['tokens_loaded_local']:>8,}  "
        f"({result['hit_rate_by_tier']['local_cpu']:.0%})")
    say(f"    recomputed                      {result['prefix_tokens_recomputed']:>8,}")
    say(f"  external hit rate                 {result['external_hit_rate']:.1%}")
    say(f"  bytes pulled                      {mib:,.1f} MiB over {result['requests_pulled']} pulls")
    say(f"  control-plane lookup p50          {result['lookup_p50_ms']:.2f} ms")
    say(f"  pull p50 (source lookup, NIXL)    {result['pull_p50_ms']:.1f} ms ({result['peer_lookup_p50_ms']:.1f} ms, "
        f"{result['transfer_p50_ms']:.1f} ms)")
    say(f"  TTFT p50 with pull                {result['ttft_pull_ms']:.0f} ms")
    say(f"  TTFT p50 recomputing              {result['ttft_recompute_ms']:.0f} ms  (pull = {ratio:.2f} x recompute)")
    say(f"  outputs match (tokens, top-{TOP_K} logprobs within {result['logprob_tolerance']:g})  "
        f"{'yes' if result['outputs_match'] else 'NO'} (largest logprob difference {result['max_logprob_diff']})")
    if "negative_control_failed" in result:
        say(f"  negative control (one misplaced block) fails the check: "
            f"{'yes' if result['negative_control_failed'] else 'NO'} "
            f"(logprob difference {result['negative_control_logprob_diff']:.3g})")


def main(argv: list[str]) -> int:
    parser = Parser(prog="kvmesh demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object (progress goes to stderr)")
    parser.add_argument("--model", choices=sorted(MODELS), default="demo",
                        help="demo: 12 layers, ~150M parameters (a pull pays off); tiny: 2 layers (a quick check)")
    parser.add_argument("--model-dir", default=".kvmesh/models", help="where built models are kept (reused)")
    parser.add_argument("--sessions", type=positive_int, default=3)
    parser.add_argument("--turns", type=positive_int, default=3)
    parser.add_argument("--prefix-tokens", type=positive_int, default=2000, help="length of the shared system prompt")
    parser.add_argument("--user-tokens", type=positive_int, default=48, help="tokens of each user message")
    parser.add_argument("--max-tokens", type=positive_int, default=16, help="tokens generated per turn")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--check", action="store_true",
                        help="also run the negative control (one misplaced block must fail the comparison)")
    parser.add_argument("--workdir", default="", help="logs and Redis data (default: a new temp dir, removed)")
    args = parser.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731

    model = build_tiny_llama(Path(args.model_dir) / args.model, **MODELS[args.model])
    spec = TinyLlamaSpec.from_checkpoint(model)
    shape = KVShape.from_checkpoint(model, dtype=DTYPE)
    block_bytes = shape.block_bytes(BLOCK_SIZE)
    with tempfile.TemporaryDirectory(prefix="kvmesh-demo-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        say(f"kvmesh demo: model {args.model} ({spec.num_layers} layers, hidden {spec.hidden}, "
            f"{shape.bytes_per_token() // 1024} KiB of KV per token, {block_bytes // 1024} KiB per "
            f"{BLOCK_SIZE}-token block); {args.sessions} sessions x {args.turns} turns on a "
            f"{args.prefix_tokens:,}-token system prompt; logs in {workdir}")
        fleet = Fleet(workdir, 2, new_key()[1], tenant=TENANT, block_bytes=block_bytes, block_tokens=BLOCK_SIZE,
                      capacity="1GiB")
        try:
            with Progress("starting Redis, the control plane and two data planes"):
                fleet.start()
            say(f"  control plane {fleet.control_plane.address}; data planes "
                + ", ".join(f"{n} {p.address}" for n, p in fleet.data_planes.items())
                + f"; every gRPC link mutual TLS (CA in {fleet.tls.directory})")
            connector = {"model": MODEL_NAME, "weight_version": WEIGHT_VERSION}
            # vLLM's own prefix cache is off: every reused token goes through kvmesh's tiers, so hit rates and
            # TTFTs are the fleet cache's, not an engine re-serving what it computed itself.
            engines = {name: fleet.start_engine(name, model, node, connector=dict(connector), max_model_len=4096,
                                                enable_prefix_caching=False)
                       for name, node in (("a", "dp1"), ("b", "dp2"))}
            with Progress("starting two vLLM engines (~40-90 s on 2 cores)"):
                for engine in engines.values():
                    engine.wait_ready()
                    # Warm-up (first-forward costs and the compilation of the top-k logprob path stay out of the
                    # TTFTs), nothing loaded or saved.
                    engine.generate(list(range(2, 2 + 4 * BLOCK_SIZE)), 2, {"kvmesh": {"load": False, "save": False}},
                                    logprobs=TOP_K)
            turns, outputs_match, last_pulled = run_scenario(fleet, engines, args, spec.vocab, say)
            control: dict[str, Any] = {}
            if args.check and last_pulled:
                fleet.stop_engine("b")  # room for the third engine
                with Progress("negative control: an engine that misplaces one loaded block"):
                    control = negative_control(fleet, model, connector, last_pulled, args)
        finally:
            fleet.stop()
    result = {**summarize(turns, outputs_match, block_bytes), **control}
    _print_summary(result, say)
    if args.json:
        print(json.dumps(result), flush=True)
    checked = not args.check or result.get("negative_control_failed", False)
    return 0 if outputs_match and checked else 1


if __name__ == "__main__":
    sys.exit(run_command("kvmesh demo", main, sys.argv[1:]))  # one line for any error, as `kvmesh` gives
