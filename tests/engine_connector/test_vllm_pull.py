"""Real vLLM CPU engines on two nodes: asynchronous pulls, what the engine computes from them, failures.

One fleet (Redis, control plane, dp1, dp2) and three engine processes, at most two at a time:

* ``engine1`` (on dp1) runs prefixes A, C, F (their blocks go to dp1), the references (each
  prompt recomputed on a cold cache with loads off) and the prefill of a P/D split;
* ``engine2`` (on dp2, ``pull_timeout_ms`` 3 s), in order:
  B = A + suffix pulled from dp1 (async load; logprobs must match the reference);
  the decode half of the P/D split (``remote_prefiller``); E = C + suffix while dp1 is frozen
  (SIGSTOP) and two other requests decode (they keep decoding, E recomputes within the
  deadline); D = F + suffix while dp1 is killed mid-pull (recompute); then its metrics;
* ``engine2m`` (on dp2, ``misplace_one_block``): the negative control, B again from dp2's tier with
  one block taken from the wrong slot: the same comparison must fail.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmesh_apps.engine_host import DTYPE
from kvmesh_apps.fleet import Fleet
from kvmesh_apps.kv_check import LOGPROB_TOLERANCE, max_logprob_diff, same_computation
from kvmesh_apps.kv_shape import KVShape
from kvmesh_apps.tiny_model import TinyLlamaSpec

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl, pytest.mark.timeout(1500)]

BLOCK_SIZE = 32
PREFIX_LEN = 1000
SUFFIX_LEN = 200
MAX_TOKENS = 16
TOP_K = 5
PULL_TIMEOUT_MS = 3000
QUIET = {"kvmesh": {"load": False, "save": False}}


@dataclass(frozen=True)
class Run:
    prompts: dict[str, list[int]]
    reference: dict[str, dict[str, Any]]
    engine1: dict[str, dict[str, Any]]
    engine2: dict[str, dict[str, Any]]
    misplaced: dict[str, Any]
    metrics: dict[str, float]
    fleet: Fleet
    trace_dir: Path


def _source(fleet: Fleet, node: str, kind: str = "remote_kv_source") -> dict[str, Any]:
    host, port = fleet.data_planes[node].address.rsplit(":", 1)
    return {kind: {"kv_request_id": "a-1", "remote_host": host, "remote_port": int(port), "remote_node_id": node}}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, start_fleet):
    spec = TinyLlamaSpec.from_checkpoint(tiny_model)
    trace_dir = tmp_path_factory.mktemp("traces")
    fleet = start_fleet(KVShape.from_checkpoint(tiny_model, dtype=DTYPE).block_bytes(BLOCK_SIZE), trace_dir=trace_dir)
    dp1 = fleet.data_planes["dp1"].proc
    try:
        rng = np.random.default_rng(7)
        draw = lambda n: rng.integers(2, spec.vocab, n).tolist()  # noqa: E731
        a, c, f = draw(PREFIX_LEN), draw(PREFIX_LEN), draw(PREFIX_LEN)
        prompts = {"A": a, "B": a + draw(SUFFIX_LEN), "C": c, "E": c + draw(SUFFIX_LEN), "F": f,
                   "D": f + draw(SUFFIX_LEN), "P": draw(PREFIX_LEN), "R1": draw(64), "R2": draw(64)}

        engine1 = fleet.start_engine("engine1", tiny_model, "dp1")
        engine2 = fleet.start_engine("engine2", tiny_model, "dp2", connector={"pull_timeout_ms": PULL_TIMEOUT_MS})
        engine1.wait_ready(), engine2.wait_ready()
        ref = {name: engine1.generate(prompts[name], MAX_TOKENS, QUIET, reset_prefix_cache=True, logprobs=TOP_K)
               for name in ("B", "E", "D", "P")}
        out1 = {name: engine1.generate(prompts[name], MAX_TOKENS) for name in ("A", "C", "F")}
        out1["P"] = engine1.generate(prompts["P"], 1, {"remote_decoder": {"kv_request_id": "pd-1"}})

        out2 = {"B": engine2.generate(prompts["B"], MAX_TOKENS, _source(fleet, "dp1"), logprobs=TOP_K)}
        # The noise floor: B computed by another engine process (loads off), against engine1's recompute.
        out2["B-recompute"] = engine2.generate(prompts["B"], MAX_TOKENS, QUIET, reset_prefix_cache=True, logprobs=TOP_K)
        out2["P"] = engine2.generate(prompts["P"], MAX_TOKENS,
                                     {"remote_prefiller": out1["P"]["kv_transfer_params"]["remote_kv_source"]},
                                     logprobs=TOP_K)
        dp1.send_signal(signal.SIGSTOP)  # frozen: accepts connections, answers nothing
        try:
            out2.update(engine2.concurrent([
                {"id": "R1", "prompt": prompts["R1"], "max_tokens": 1200},
                {"id": "R2", "prompt": prompts["R2"], "max_tokens": 1200},
                {"id": "E", "prompt": prompts["E"], "max_tokens": MAX_TOKENS, "logprobs": TOP_K,
                 "kv_transfer_params": _source(fleet, "dp1"), "at_s": 0.5},
            ]))
            # Killed while dp2's pull of F's blocks waits on it (resumed first, so the fleet sees it alive).
            dp1.send_signal(signal.SIGCONT)
            time.sleep(1.0)
            dp1.send_signal(signal.SIGSTOP)
            killer = threading.Timer(1.0, fleet.data_planes["dp1"].kill)
            killer.start()
            started = time.perf_counter()
            out2["D"] = engine2.generate(prompts["D"], MAX_TOKENS, _source(fleet, "dp1"), logprobs=TOP_K)
            out2["D"]["wall_s"] = time.perf_counter() - started
            killer.join()
        finally:
            if dp1.poll() is None:
                dp1.send_signal(signal.SIGCONT)
        metrics = engine2.metrics()
        fleet.stop_engine("engine1"), fleet.stop_engine("engine2")

        engine2m = fleet.start_engine("engine2m", tiny_model, "dp2", connector={"misplace_one_block": True})
        misplaced = engine2m.wait_ready().generate(prompts["B"], MAX_TOKENS, logprobs=TOP_K)
        yield Run(prompts, ref, out1, out2, misplaced, metrics, fleet, trace_dir)
    finally:
        if dp1.poll() is None:
            dp1.send_signal(signal.SIGCONT)
        fleet.stop()


def _report(output: dict[str, Any]) -> dict[str, Any]:
    return output["kv_transfer_params"]["kvmesh"]


def test_engine1_saves_the_prefix_blocks(run: Run) -> None:
    for name in ("A", "C", "F"):
        assert _report(run.engine1[name])["stored_blocks"] == PREFIX_LEN // BLOCK_SIZE


def test_a_pulled_prefix_gives_the_logprobs_of_a_recompute(run: Run) -> None:
    b = run.engine2["B"]
    report = _report(b)
    assert report["source"] == "dp1" and report["outcome"] == "pulled", report
    assert report["peer_tokens"] >= 0.9 * PREFIX_LEN and b["num_cached_tokens"] >= 0.9 * PREFIX_LEN
    assert report["failed_blocks"] == 0 and report["wait_ms"] > 0
    same, diff = same_computation(b, run.reference["B"])
    assert same, f"pulled run differs from recompute by {diff} (tolerance {LOGPROB_TOLERANCE})"


def test_two_recomputes_differ_by_far_less_than_the_tolerance(run: Run) -> None:
    noise = max_logprob_diff(run.engine2["B-recompute"]["logprobs"], run.reference["B"]["logprobs"])
    pulled = max_logprob_diff(run.engine2["B"]["logprobs"], run.reference["B"]["logprobs"])
    misplaced = max_logprob_diff(run.misplaced["logprobs"], run.reference["B"]["logprobs"])
    print(f"logprob differences: recompute vs recompute {noise:.3g}, pulled vs recompute {pulled:.3g}, "
          f"misplaced block vs recompute {misplaced:.3g} (tolerance {LOGPROB_TOLERANCE:g})")
    assert noise <= LOGPROB_TOLERANCE / 10


def test_negative_control_one_misplaced_block_fails_the_same_check(run: Run) -> None:
    bad = run.misplaced
    assert _report(bad)["local_tokens"] >= 0.9 * PREFIX_LEN  # it loaded B's prefix (from dp2's tier)
    same, diff = same_computation(bad, run.reference["B"])
    assert not same and diff > 10 * LOGPROB_TOLERANCE, diff


def test_prefill_decode_split_across_two_engines_matches_one_engine(run: Run) -> None:
    prefill, decode = run.engine1["P"], run.engine2["P"]
    source = prefill["kv_transfer_params"]["remote_kv_source"]
    assert source["remote_node_id"] == "dp1" and source["cached_tokens"] == PREFIX_LEN // BLOCK_SIZE * BLOCK_SIZE
    assert _report(decode)["peer_tokens"] == (PREFIX_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE
    same, diff = same_computation(decode, run.reference["P"])
    assert same, diff


def test_frozen_source_recomputes_within_the_deadline_while_others_keep_decoding(run: Run) -> None:
    e = run.engine2["E"]
    report = _report(e)
    # The connector's deadline and the data plane's own bound of the Pull are the same length: either ends it.
    assert report["outcome"] in ("deadline", "pull_failed", "pull_missed") and report["loaded_tokens"] == 0, report
    assert PULL_TIMEOUT_MS * 0.9 <= report["wait_ms"] <= PULL_TIMEOUT_MS + 1000
    assert same_computation(e, run.reference["E"])[0]
    # While E waited for its pull, the running requests produced tokens.
    waited = (e["added_s"], e["added_s"] + report["wait_ms"] / 1e3)
    during = [t for name in ("R1", "R2") for t in run.engine2[name]["token_times"] if waited[0] <= t <= waited[1]]
    assert len(during) >= 20, f"{len(during)} tokens decoded in {report['wait_ms']:.0f} ms"


def test_source_killed_mid_pull_recomputes_with_identical_output(run: Run) -> None:
    d = run.engine2["D"]
    report = _report(d)
    assert report["loaded_tokens"] == 0 and report["outcome"] in ("pull_failed", "pull_missed", "deadline"), report
    assert same_computation(d, run.reference["D"])[0]
    assert d["wall_s"] < PULL_TIMEOUT_MS / 1e3 + 10


def test_loads_and_failures_show_in_vllms_own_metrics(run: Run) -> None:
    m = run.metrics
    peer = sum(v for k, v in m.items() if k.startswith("vllm:kvmesh_loaded_tokens") and "tier=peer" in k)
    assert peer >= _report(run.engine2["B"])["peer_tokens"] + _report(run.engine2["P"])["peer_tokens"]
    assert sum(v for k, v in m.items() if k.startswith("vllm:kvmesh_pulled_bytes")) > 0
    assert sum(v for k, v in m.items() if k.startswith("vllm:kvmesh_load_failures")) >= 2  # frozen, killed
    # vLLM's own prefix-cache counter split by tier (get_external_cache_hit_sources).
    p2p = sum(v for k, v in m.items() if k.startswith("vllm:prompt_tokens_cached_by_source") and "source=p2p" in k)
    assert p2p >= _report(run.engine2["B"])["peer_tokens"], sorted(m)


def test_the_pull_is_one_trace_from_the_engine_to_the_source(run: Run) -> None:
    spans = [json.loads(line) for path in run.trace_dir.glob("*.jsonl") for line in path.read_text().splitlines()]
    roots = [s for s in spans if s["name"] == "kvmesh.connector.load" and s["attributes"]["kvmesh.tier"] == "peer"]
    assert roots and all(r["service"] == "kvmesh-engine-engine2" for r in roots)
    every = {("kvmesh-data-plane-dp2", "Pull"), ("kvmesh-data-plane-dp1", "Lookup")}
    traced = []
    for root in roots:
        servers = {(s["service"], s["name"].rsplit("/", 1)[-1]) for s in spans
                   if s["trace_id"] == root["trace_id"] and s["kind"] == "SERVER"}
        assert every <= servers, servers
        assert ("kvmesh-data-plane-dp2", "Acquire") not in servers  # the Pull pinned the prefix in the same call
        traced.append(servers)
    # The grant is fetched by the first pull from dp1 and cached by dp2 for the next ones.
    assert any(("kvmesh-control-plane", "IssuePullGrant") in servers for servers in traced)
