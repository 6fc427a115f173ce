"""``kvmesh bench engine``: what pulls cost the requests an engine is already running, on real vLLM CPU engines.

A local fleet (two data planes) and two engines: ``src`` on dp1 computes the prefixes (its
connector saves them to dp1); ``dst`` on dp2 runs every measured scenario, each through the
engine host's ``concurrent`` op (requests added at given times, the engine stepped in a loop,
each token's arrival time recorded):

* ``baseline``: ``--running`` short requests decoding, nothing else;
* ``pulls``: the same, plus ``--pullers`` requests (one ``--prefix-tokens`` prefix each, named
  source dp1) added one every 100 ms from 3 s on; the window runs from the first one's arrival to
  the last one's answer (its lookup and pull in flight; copies and suffix prefill come after).
  ``decode_ratio_during_pulls``: the running requests' tokens/s in
  that window over the baseline run's in the same window; ``decode_ratio_vs_before_pulls``: over
  the same run's in the window of equal length just before (immune to load that changes between
  runs on a shared machine);
* ``frozen``: the same with dp1 stopped (SIGSTOP) and one puller: it waits, then recomputes.
  ``frozen_source_fallback_ms``: its wait (the connector's ``wait_ms``), bounded by
  ``pull_timeout_ms``; ``frozen_source_decode_ratio`` (``_vs_before``) as above over its wait;
* ``coalesced``: ``--coalesced`` requests on one new prefix at once (16 by default):
  ``coalesced_bytes_ratio`` is the bytes their pulls moved (the data plane's ``bytes_pulled``
  per Pull, summed) over one prefix's bytes; 1.0 when concurrent pulls share one transfer;
* ``pull vs recompute`` (``--repetitions`` pairs, :mod:`kvmesh_apps.bench.engine_pace`): the same
  ``--pullers`` requests admitted while the running requests decode, pulling their prefix and
  recomputing it: ``decode_ratio_pull_vs_recompute`` (mean, 95 % interval, per repetition);
* ``isolated`` (``--repetitions`` pairs): ``dst`` restarted pinned to the first CPU this process
  may use, every other process of the benchmark (Redis, control plane, both data planes, ``src``,
  this driver) pinned to the others; ``decode_ratio_during_pulls_isolated``: the running requests'
  tokens/s while ``--pullers`` pulls are in flight over a run without pulls, same window, and
  ``decode_ratio_pulled_vs_cached_isolated`` over a run admitting the same prefixes from the
  engine's prefix cache. ``None`` with fewer than 2 CPUs. ``pinning`` in the JSON says what ran where.

``outputs_match``: every pulled or fallen-back request's tokens and top-5 logprobs equal a
recompute of the same prompt on ``dst`` (cold cache, loads off) within
:data:`kvmesh_apps.kv_check.LOGPROB_TOLERANCE`. With ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.command_line import Parser, positive_int, run_command
from kvmesh_apps.bench.cpu_pinning import descendants, pin_process, spawning_on
from kvmesh_apps.bench.decode_windows import decode_ratios, pull_window, report
from kvmesh_apps.bench.engine_pace import during_pulls_isolated, pull_vs_recompute
from kvmesh_apps.bench.figures import finish, progress
from kvmesh_apps.engine_host import DTYPE
from kvmesh_apps.fleet import Fleet
from kvmesh_apps.kv_check import same_computation
from kvmesh_apps.kv_shape import KVShape
from kvmesh_apps.tiny_model import TEST_INIT_STD, TinyLlamaSpec, build_tiny_llama
from tenancy.api_keys import new_key

BLOCK_SIZE = 32
TOP_K = 5
QUIET = {"kvmesh": {"load": False, "save": False}}
PULL_START_S = 3.0  # leaves a window of the same run before the pulls, as long as the longest pull window
PULL_SPACING_S = 0.1
PACE_SLACK_S = 5.0  # the paced runs' running requests decode this long past the last arrival


def run(args: argparse.Namespace, say) -> dict[str, Any]:
    model = build_tiny_llama(Path(args.model_dir) / "tiny-sharp", init_std=TEST_INIT_STD)
    spec = TinyLlamaSpec.from_checkpoint(model)
    block_bytes = KVShape.from_checkpoint(model, dtype=DTYPE).block_bytes(BLOCK_SIZE)
    rng = np.random.default_rng(args.seed)
    draw = lambda n: rng.integers(2, spec.vocab, n).tolist()  # noqa: E731
    paced = [f"{kind}-{r}-{i}" for kind in ("pvr", "iso") for r in range(args.repetitions)
             for i in range(args.pullers)]
    prefixes = {name: draw(args.prefix_tokens) for name in
                [f"pull-{i}" for i in range(args.pullers)] + ["frozen", "coalesced"] + paced}
    suffix = lambda: draw(16)  # noqa: E731
    running = [{"id": f"run-{i}", "prompt": draw(64), "max_tokens": args.decode_tokens} for i in range(args.running)]

    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-engine-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        # Room for every prefix twice over (dp2 keeps what it pulled; nothing may be evicted before it is pulled).
        slots = max(4096, 2 * len(prefixes) * math.ceil(args.prefix_tokens / BLOCK_SIZE))
        fleet = Fleet(workdir, 2, new_key()[1], tenant="bench", block_bytes=block_bytes, block_tokens=BLOCK_SIZE,
                      capacity=f"{slots * block_bytes}")
        try:
            fleet.start()
            host, port = fleet.data_planes["dp1"].address.rsplit(":", 1)
            source = {"remote_kv_source": {"kv_request_id": "bench", "remote_host": host, "remote_port": int(port),
                                           "remote_node_id": "dp1"}}
            src = fleet.start_engine("src", model, "dp1")
            dst_spec = {"connector": {"pull_timeout_ms": args.pull_timeout_ms},
                        "max_num_seqs": args.coalesced + args.running + 4}
            dst = fleet.start_engine("dst", model, "dp2", **dst_spec)
            say("starting two vLLM engines ...")
            src.wait_ready(), dst.wait_ready()
            for prefix in prefixes.values():
                src.generate(prefix, 1)  # its connector saves the prefix to dp1
            # Warm-up, with logprobs: vLLM compiles the top-k logprob path on first use (~10 s here, a stall that
            # would land in the first measured window).
            dst.generate(draw(64), 4, QUIET, logprobs=TOP_K)

            say("baseline: running requests alone")
            baseline = dst.concurrent(running)
            pullers = [{"id": f"pull-{i}", "prompt": prefixes[f"pull-{i}"] + suffix(), "max_tokens": 4,
                        "logprobs": TOP_K, "kv_transfer_params": source,
                        "at_s": PULL_START_S + i * PULL_SPACING_S} for i in range(args.pullers)]
            say(f"pulls: {args.pullers} pulls of {args.prefix_tokens} tokens while they run")
            pulled = dst.concurrent(running + pullers)
            if args.workdir:
                (workdir / "scenarios.json").write_text(json.dumps({"baseline": baseline, "pulls": pulled}))
            start, end = pull_window(pulled, [p["id"] for p in pullers])
            decode_ratio, decode_ratio_before = decode_ratios(pulled, baseline, args.running, (start, end))

            say("frozen: the source stopped (SIGSTOP) during one pull")
            frozen_req = {"id": "frozen", "prompt": prefixes["frozen"] + suffix(), "max_tokens": 4, "logprobs": TOP_K,
                          "kv_transfer_params": source, "at_s": PULL_START_S}
            dp1 = fleet.data_planes["dp1"].proc
            dp1.send_signal(signal.SIGSTOP)
            try:
                frozen = dst.concurrent(running + [frozen_req])
            finally:
                dp1.send_signal(signal.SIGCONT)
            frozen_report = report(frozen["frozen"])
            fallback_ms = frozen_report.get("wait_ms", 0.0)
            frozen_ratio, frozen_ratio_before = decode_ratios(frozen, baseline, args.running,
                                                              pull_window(frozen, ["frozen"]))

            say(f"coalesced: {args.coalesced} requests on one {args.prefix_tokens}-token prefix at once")
            coalesced_reqs = [{"id": f"co-{i}", "prompt": prefixes["coalesced"] + suffix(), "max_tokens": 4,
                               "logprobs": TOP_K, "kv_transfer_params": source} for i in range(args.coalesced)]
            coalesced = dst.concurrent(coalesced_reqs)
            prefix_bytes = (args.prefix_tokens // BLOCK_SIZE) * block_bytes
            moved = sum(report(r).get("bytes_pulled", 0) for r in coalesced.values())

            # The paced scenarios' running requests decode only as long as their windows need.
            per_request_tok_s = len(baseline["run-0"]["token_times"]) / baseline["run-0"]["token_times"][-1]
            paced_tokens = min(args.decode_tokens, math.ceil(per_request_tok_s * (
                PULL_START_S + args.pullers * PULL_SPACING_S + PACE_SLACK_S)))
            paced_running = [{**r, "max_tokens": paced_tokens} for r in running]
            admitted = lambda kind, rep, params: [  # noqa: E731
                {"id": f"{kind}-{rep}-{i}", "prompt": prefixes[f"{kind}-{rep}-{i}"] + suffix(), "max_tokens": 4,
                 "logprobs": TOP_K, "kv_transfer_params": params, "at_s": PULL_START_S + i * PULL_SPACING_S}
                for i in range(args.pullers)]
            pace, pace_pairs = pull_vs_recompute(
                dst, paced_running, [admitted("pvr", r, {}) for r in range(args.repetitions)], source, draw(8), say)

            say("references: every pulled prompt recomputed on a cold cache")
            checked = [(p, pulled[p["id"]]) for p in pullers] + [(frozen_req, frozen["frozen"])] + \
                [(r, coalesced[r["id"]]) for r in coalesced_reqs]
            matches: dict[str, bool] = {}
            worst = 0.0
            for request, result in checked:
                ref = dst.generate(request["prompt"], request["max_tokens"], QUIET, reset_prefix_cache=True,
                                   logprobs=TOP_K)
                matches[request["id"]], diff = same_computation(result, ref)
                worst = max(worst, diff)
            for request, result, recomputed in pace_pairs:  # the same prompt pulled and recomputed, same engine
                matches[request["id"]], diff = same_computation(result, recomputed)
                worst = max(worst, diff)

            cpus = sorted(os.sched_getaffinity(0))
            pinning: dict[str, Any] = {"cpus": cpus}
            isolated: dict[str, Any] = {"decode_ratio_during_pulls_isolated": None}
            if len(cpus) >= 2:
                engine_cpus, other_cpus = {cpus[0]}, set(cpus[1:])
                say(f"isolated: dst restarted on CPU {cpus[0]}, the fleet, src and this driver on {sorted(other_cpus)}")
                fleet.stop_engine("dst")
                for pid in [os.getpid(), *descendants(os.getpid())]:
                    pin_process(pid, other_cpus)
                with spawning_on(engine_cpus):
                    dst = fleet.start_engine("dst-pinned", model, "dp2", **dst_spec)
                pin_process(os.getpid(), other_cpus)  # the thread reading the engine's output began on its CPU
                dst.wait_ready()
                dst.generate(draw(64), 4, QUIET, logprobs=TOP_K)
                isolated = during_pulls_isolated(
                    dst, paced_running, [admitted("iso", r, source) for r in range(args.repetitions)],
                    [admitted("iso", r, {}) for r in range(args.repetitions)], say)
                pinning.update(engine=sorted(engine_cpus), others=sorted(other_cpus),
                               engine_processes="dst's engine host and everything it started (vLLM's engine core, "
                                                "its OpenMP threads: vLLM binds them to the engine's CPU)",
                               other_processes="Redis, control plane, data planes dp1 and dp2, src engine, driver")
            else:
                pinning["skipped"] = "fewer than 2 CPUs: nothing to isolate the engine on"
        finally:
            fleet.stop()

    pulled_reports = [report(pulled[p["id"]]) for p in pullers]
    return {
        **pace,
        **isolated,
        "pinning": pinning,
        "repetitions": args.repetitions,
        "paced_running_tokens": paced_tokens,
        "decode_ratio_during_pulls": decode_ratio,
        "decode_ratio_vs_before_pulls": decode_ratio_before,
        "pull_window_ms": round((end - start) * 1e3, 1),
        "pulls_in_window": args.pullers,
        "pull_ms_p50": round(float(np.median([r.get("pull_ms", 0.0) for r in pulled_reports])), 1),
        "peer_tokens_loaded": sum(r.get("peer_tokens", 0) for r in pulled_reports),
        "frozen_source_fallback_ms": round(fallback_ms, 1),
        "frozen_source_outcome": frozen_report.get("outcome", ""),
        "frozen_source_decode_ratio": frozen_ratio,
        "frozen_source_decode_ratio_vs_before": frozen_ratio_before,
        "frozen_source_output_match": matches["frozen"],
        "pull_timeout_ms": args.pull_timeout_ms,
        "coalesced_requests": args.coalesced,
        "coalesced_bytes_moved": moved,
        "prefix_bytes": prefix_bytes,
        "coalesced_bytes_ratio": round(moved / prefix_bytes, 3),
        "coalesced_peer_tokens": sum(report(r).get("peer_tokens", 0) for r in coalesced.values()),
        "coalesced_joined_blocks": sum(report(r).get("joined_blocks", 0) for r in coalesced.values()),
        "outputs_match": all(matches.values()),
        "max_logprob_diff": worst,
        "running_requests": args.running,
        "prefix_tokens": args.prefix_tokens,
        "model": f"tiny ({spec.num_layers} layers, hidden {spec.hidden}, {block_bytes // 1024} KiB blocks)",
    }


def main(argv: list[str]) -> int:
    parser = Parser(prog="kvmesh bench engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object (progress goes to stderr)")
    parser.add_argument("--model-dir", default=".kvmesh/models", help="where built models are kept (reused)")
    parser.add_argument("--prefix-tokens", type=positive_int, default=2000)
    parser.add_argument("--pullers", type=positive_int, default=8, help="pulls during the decode window")
    parser.add_argument("--coalesced", type=positive_int, default=16, help="simultaneous requests on one prefix")
    parser.add_argument("--running", type=positive_int, default=4, help="requests already decoding")
    parser.add_argument("--decode-tokens", type=positive_int, default=1500, help="tokens each running request decodes (long enough to cover every window)")
    parser.add_argument("--pull-timeout-ms", type=positive_int, default=2000)
    parser.add_argument("--repetitions", type=positive_int, default=4,
                        help="paired runs of the pull-vs-recompute and isolated scenarios")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--workdir", default="", help="logs of the fleet and engines (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    say = progress(args.json)
    started = time.perf_counter()
    result = run(args, say)
    finish(result, started, args.json, say, width=28)
    return 0 if result["outputs_match"] else 1


if __name__ == "__main__":
    sys.exit(run_command("kvmesh bench engine", main, sys.argv[1:]))  # one line for any error, as `kvmesh` gives
