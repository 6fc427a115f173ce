"""A model shape no other test uses, on a fleet sized by kvmesh_apps.kv_shape (never a typed-in byte count).

The checkpoint: 3 layers, hidden 128, 4 query heads over 1 KV head (head size 32), written in float32 and served
with vLLM's ``--dtype auto`` and ``--block-size 64``; on CPU vLLM serves a float32 checkpoint in bfloat16, so
the derived slot is 2 x 3 x 1 x 32 x 2 bytes x 64 tokens = 24,576 bytes (a reading of config.json alone would
say twice that). The connector's own size check at engine start is the oracle that this equals vLLM's block:

* ``a`` (dp1) and ``b`` (dp2) start on the derived slots; ``fp32`` (dp2, ``--dtype float32``: 49,152-byte
  blocks) is refused at start, and the connector's message, with the remedy, reaches the engine's output;
* ``a`` computes the reference (a cold recompute with loads off) and then the prefix, which it saves to dp1;
* ``b`` pulls the prefix from dp1 and computes the rest: its top-5 logprobs must match the reference within
  ``LOGPROB_TOLERANCE`` (kvmesh_apps.kv_check, as in test_vllm_pull.py), and a recompute on ``b`` shows the
  noise between two engine processes;
* negative control: ``a`` runs with ``misplace_one_block`` (it only affects loads, so its reference and saves
  are sound); after its prefix cache is reset it loads the prefix from dp1 with one block from the wrong
  slot, and the same comparison must fail.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvmesh_apps.engine_host import EngineError
from kvmesh_apps.fleet import Fleet
from kvmesh_apps.kv_check import LOGPROB_TOLERANCE, max_logprob_diff, same_computation
from kvmesh_apps.kv_shape import KVShape
from kvmesh_apps.tiny_model import TEST_INIT_STD, build_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl, pytest.mark.timeout(900)]

BLOCK_SIZE = 64
PREFIX_LEN = 640  # 10 blocks
SUFFIX_LEN = 64
MAX_TOKENS = 16
TOP_K = 5
QUIET = {"kvmesh": {"load": False, "save": False}}
SHAPE = dict(num_layers=3, hidden=128, heads=4, kv_heads=1, init_std=TEST_INIT_STD)


@dataclass(frozen=True)
class Run:
    shape: KVShape
    fleet: Fleet
    refused: str
    reference: dict[str, Any]
    pulled: dict[str, Any]
    recompute_b: dict[str, Any]
    misplaced: dict[str, Any]
    wall_s: float


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, start_fleet):
    started = time.perf_counter()
    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "gqa-1kv", **SHAPE)
    shape = KVShape.from_checkpoint(model)  # vLLM's --dtype auto
    fleet = start_fleet(shape.block_bytes(BLOCK_SIZE), block_tokens=BLOCK_SIZE)
    try:
        engine = dict(block_size=BLOCK_SIZE, max_model_len=1024)
        a = fleet.start_engine("a", model, "dp1", dtype="auto", connector={"misplace_one_block": True}, **engine)
        b = fleet.start_engine("b", model, "dp2", dtype="auto", **engine)
        fp32 = fleet.start_engine("fp32", model, "dp2", dtype="float32", **engine)
        with pytest.raises(EngineError, match="exited"):
            fp32.wait_ready()
        fleet.stop_engine("fp32")
        refused = fp32.log_path.read_text(errors="replace")  # all the engine printed, as `vllm serve` shows it
        a.wait_ready(), b.wait_ready()

        rng = np.random.default_rng(11)
        prefix = rng.integers(2, 2048, PREFIX_LEN).tolist()
        prompt = prefix + rng.integers(2, 2048, SUFFIX_LEN).tolist()
        reference = a.generate(prompt, MAX_TOKENS, QUIET, reset_prefix_cache=True, logprobs=TOP_K)
        a.generate(prefix, 1)  # its blocks go to dp1
        host, port = fleet.data_planes["dp1"].address.rsplit(":", 1)
        source = {"remote_kv_source": {"kv_request_id": "shape-1", "remote_host": host, "remote_port": int(port),
                                       "remote_node_id": "dp1"}}
        pulled = b.generate(prompt, MAX_TOKENS, source, logprobs=TOP_K)
        recompute_b = b.generate(prompt, MAX_TOKENS, QUIET, reset_prefix_cache=True, logprobs=TOP_K)
        misplaced = a.generate(prompt, MAX_TOKENS, reset_prefix_cache=True, logprobs=TOP_K)
        yield Run(shape, fleet, refused, reference, pulled, recompute_b, misplaced,
                  time.perf_counter() - started)
    finally:
        fleet.stop()


def _report(output: dict[str, Any]) -> dict[str, Any]:
    return output["kv_transfer_params"]["kvmesh"]


def test_the_derived_slot_is_vllms_block_and_a_mismatch_is_refused_with_the_remedy(run: Run) -> None:
    assert (run.shape.dtype, run.shape.block_bytes(BLOCK_SIZE)) == ("bfloat16", 24576)
    # The positive side of the oracle: both engines on the derived slots started and saved/loaded blocks.
    assert _report(run.pulled)["outcome"] == "pulled"
    # The negative side: float32 blocks are twice the slot; the connector's message reaches the engine's output.
    assert "has 24576-byte slots of 64-token blocks but this engine's KV blocks are 49152 bytes" in run.refused, \
        run.refused
    assert "`kvmesh up --block-bytes 49152 --block-tokens 64`" in run.refused
    assert "--dtype float32 --block-tokens 64`" in run.refused


def test_a_prefix_pulled_in_another_shape_gives_the_logprobs_of_a_recompute(run: Run) -> None:
    report = _report(run.pulled)
    assert report["source"] == "dp1" and report["failed_blocks"] == 0, report
    assert report["peer_tokens"] == PREFIX_LEN and report["bytes_pulled"] == PREFIX_LEN // BLOCK_SIZE * 24576
    noise = max_logprob_diff(run.recompute_b["logprobs"], run.reference["logprobs"])
    misplaced = max_logprob_diff(run.misplaced["logprobs"], run.reference["logprobs"])
    same, diff = same_computation(run.pulled, run.reference)
    print(f"bf16, 1 KV head, 64-token blocks: recompute vs recompute {noise:.3g}, pulled vs recompute {diff:.3g}, "
          f"misplaced block vs recompute {misplaced:.3g} (tolerance {LOGPROB_TOLERANCE:g}); "
          f"fixture {run.wall_s:.0f} s")
    assert same, f"pulled run differs from recompute by {diff} (tolerance {LOGPROB_TOLERANCE})"
    assert noise <= LOGPROB_TOLERANCE / 10


def test_negative_control_one_misplaced_block_fails_the_same_check(run: Run) -> None:
    bad = run.misplaced
    assert _report(bad)["local_tokens"] == PREFIX_LEN  # it loaded the prefix from dp1's tier
    same, diff = same_computation(bad, run.reference)
    assert not same and diff > 10 * LOGPROB_TOLERANCE, diff
