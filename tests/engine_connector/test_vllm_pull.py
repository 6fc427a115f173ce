"""Two real vLLM CPU engines on two nodes: engine 2 pulls engine 1's prefix through the data planes.

One fleet (Redis, control plane, dp1, dp2) and three engine processes, at most two at a time:

* ``reference`` (no connector, no prefix caching) beside ``engine1`` (on dp1): the expected
  greedy outputs; engine 1 runs prompts A (1,000+ tokens) and C, saving their blocks in dp1;
* ``engine2`` (on dp2) afterwards: B = A's prefix + a new suffix with ``remote_kv_source``
  naming dp1 (pulled over NIXL, then loaded); then dp1 is killed and D = C's prefix + a suffix
  names it again: the pull fails, vLLM recomputes, the output is unchanged.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvmesh_apps.fleet import Fleet
from kvmesh_apps.tiny_model import TinyLlamaSpec

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl, pytest.mark.timeout(900)]

BLOCK_SIZE = 32
PREFIX_LEN = 1000
SUFFIX_LEN = 200
MAX_TOKENS = 16
KILLED_SOURCE_BOUND_S = 20.0


@dataclass(frozen=True)
class Run:
    prompts: dict[str, list[int]]
    reference: dict[str, dict[str, Any]]
    engine1: dict[str, dict[str, Any]]
    engine2: dict[str, dict[str, Any]]
    fleet: Fleet
    trace_dir: Path


def _source(fleet: Fleet, node: str) -> dict[str, Any]:
    host, port = fleet.data_planes[node].address.rsplit(":", 1)
    return {"remote_kv_source": {"kv_request_id": "a-1", "remote_host": host, "remote_port": int(port),
                                 "remote_node_id": node}}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, start_fleet):
    spec = TinyLlamaSpec.from_checkpoint(tiny_model)
    trace_dir = tmp_path_factory.mktemp("traces")
    fleet = start_fleet(spec.kv_bytes_per_token() * BLOCK_SIZE, trace_dir=trace_dir)
    try:
        rng = np.random.default_rng(7)
        draw = lambda n: rng.integers(2, spec.vocab, n).tolist()  # noqa: E731
        a, c = draw(PREFIX_LEN), draw(PREFIX_LEN)
        prompts = {"A": a, "B": a + draw(SUFFIX_LEN), "C": c, "D": c + draw(SUFFIX_LEN)}

        reference = fleet.start_engine("reference", tiny_model, None, enable_prefix_caching=False)
        engine1 = fleet.start_engine("engine1", tiny_model, "dp1")
        reference.wait_ready(), engine1.wait_ready()
        ref = {name: reference.generate(prompts[name], MAX_TOKENS) for name in ("B", "D")}
        out1 = {name: engine1.generate(prompts[name], MAX_TOKENS) for name in ("A", "C")}
        fleet.stop_engine("reference"), fleet.stop_engine("engine1")

        engine2 = fleet.start_engine("engine2", tiny_model, "dp2").wait_ready()
        out2 = {"B": engine2.generate(prompts["B"], MAX_TOKENS, _source(fleet, "dp1"))}
        fleet.data_planes["dp1"].kill()
        started = time.perf_counter()
        out2["D"] = engine2.generate(prompts["D"], MAX_TOKENS, _source(fleet, "dp1"))
        out2["D"]["wall_s"] = time.perf_counter() - started
        yield Run(prompts, ref, out1, out2, fleet, trace_dir)
    finally:
        fleet.stop()


def _report(output: dict[str, Any]) -> dict[str, Any]:
    return output["kv_transfer_params"]["kvmesh"]


def test_engine1_saves_the_prefix_blocks(run: Run) -> None:
    for name in ("A", "C"):
        assert _report(run.engine1[name])["stored_blocks"] == PREFIX_LEN // BLOCK_SIZE


def test_engine2_loads_the_prefix_from_the_peer_with_identical_output(run: Run) -> None:
    b = run.engine2["B"]
    report = _report(b)
    shared_blocks = PREFIX_LEN // BLOCK_SIZE
    assert report["source"] == "dp1" and report["outcome"] == "pulled", report
    assert report["peer_tokens"] >= 0.9 * PREFIX_LEN
    assert b["num_cached_tokens"] >= 0.9 * PREFIX_LEN
    assert report["bytes_pulled"] >= shared_blocks * run.fleet.block_bytes
    assert report["failed_blocks"] == 0
    assert b["token_ids"] == run.reference["B"]["token_ids"]


def test_killed_source_falls_back_to_recompute_with_identical_output(run: Run) -> None:
    d = run.engine2["D"]
    report = _report(d)
    assert report["loaded_tokens"] == 0 and report["outcome"] in ("pull_missed", "miss", "pull_failed"), report
    assert d["num_cached_tokens"] == 0
    assert d["token_ids"] == run.reference["D"]["token_ids"]
    assert d["wall_s"] < KILLED_SOURCE_BOUND_S


def test_the_pull_is_one_trace_from_the_engine_to_the_source(run: Run) -> None:
    spans = [json.loads(line) for path in run.trace_dir.glob("*.jsonl") for line in path.read_text().splitlines()]
    (root,) = [s for s in spans if s["name"] == "kvmesh.connector.load" and s["attributes"]["kvmesh.tier"] == "peer"]
    assert root["service"] == "kvmesh-engine-engine2" and root["attributes"]["kvmesh.source_node"] == "dp1"
    servers = {(s["service"], s["name"].rsplit("/", 1)[-1]) for s in spans
               if s["trace_id"] == root["trace_id"] and s["kind"] == "SERVER"}
    assert {("kvmesh-data-plane-dp2", "Pull"), ("kvmesh-control-plane", "IssuePullGrant"),
            ("kvmesh-data-plane-dp1", "Lookup"), ("kvmesh-data-plane-dp2", "Acquire")} <= servers
