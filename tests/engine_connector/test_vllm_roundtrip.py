"""KvmeshConnector on real vLLM CPU engines: save in one engine, load in another.

Three engine processes, at most two at a time (~2 minutes on 2 cores):

* ``reference``: no connector; the expected greedy outputs.
* ``writer`` (alongside ``reference``): runs the 1,000-token prefix, saving its blocks.
* ``reader`` (afterwards; local prefix caching off, so every hit comes from the store):
  prefix + suffix, loaded from the store; then the store's data is corrupted and the same
  prompt runs again (loads fail, vLLM recomputes); then again (the store has healed);
  then with ``kv_transfer_params`` turning loads off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_connector.block_store import ShmBlockStore
from kvmesh.hashing import BlockHasher, HashAlgo
from kvmesh.tiny_model import TinyLlamaSpec

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK_SIZE = 32  # engine_driver's block size
PREFIX_LEN = 1000
SUFFIX_LEN = 200
MAX_TOKENS = 16
STORE_SLOTS = 256


@dataclass(frozen=True)
class Roundtrip:
    prefix: list[int]
    prompt: list[int]
    reference: dict[str, dict[str, Any]]
    writer: dict[str, dict[str, Any]]
    reader: dict[str, dict[str, Any]]


def _generate(name: str, tokens: list[int], params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompt": tokens, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}


@pytest.fixture(scope="module")
def roundtrip(run_engines, tiny_model: Path, shm_store_path: Path) -> Roundtrip:
    rng = np.random.default_rng(7)
    vocab = TinyLlamaSpec.from_checkpoint(tiny_model).vocab
    prefix = rng.integers(2, vocab, PREFIX_LEN).tolist()
    prompt = prefix + rng.integers(2, vocab, SUFFIX_LEN).tolist()
    model = str(tiny_model)
    connector = {"store_path": str(shm_store_path), "store_slots": STORE_SLOTS}
    reference, writer = run_engines(
        [
            {"model": model, "connector": None, "steps": [_generate("prefix", prefix), _generate("prompt", prompt)]},
            {"model": model, "connector": connector, "steps": [_generate("prefix", prefix)]},
        ]
    )
    (reader,) = run_engines(
        [
            {
                "model": model,
                "connector": connector,
                "enable_prefix_caching": False,
                "steps": [
                    _generate("load", prompt),
                    {"op": "corrupt_store"},
                    _generate("corrupt", prompt),
                    _generate("healed", prompt),
                    _generate("no_load", prompt, {"kvmesh": {"load": False}}),
                ],
            }
        ]
    )
    return Roundtrip(prefix, prompt, reference["outputs"], writer["outputs"], reader["outputs"])


def _report(output: dict[str, Any]) -> dict[str, int]:
    return output["kv_transfer_params"]["kvmesh"]


def test_writer_saves_prefix_blocks_keyed_by_vllm_block_hashes(
    roundtrip: Roundtrip, tiny_model: Path, shm_store_path: Path
) -> None:
    written = roundtrip.writer["prefix"]
    assert written["token_ids"] == roundtrip.reference["prefix"]["token_ids"]
    full_blocks = PREFIX_LEN // BLOCK_SIZE
    assert _report(written) == {"loaded_tokens": 0, "failed_blocks": 0, "stored_blocks": full_blocks}

    # The store keys are vLLM's own block hashes, reproducible outside vLLM.
    spec = TinyLlamaSpec.from_checkpoint(tiny_model)
    store = ShmBlockStore(
        shm_store_path, block_nbytes=spec.kv_bytes_per_token() * BLOCK_SIZE, num_slots=STORE_SLOTS
    )
    try:
        hashes = BlockHasher(HashAlgo.SHA256_CBOR).block_hashes(roundtrip.prefix, BLOCK_SIZE)
        assert store.lookup(hashes) == full_blocks
    finally:
        store.close()


def test_reader_loads_prefix_from_store_with_identical_output(roundtrip: Roundtrip) -> None:
    loaded = roundtrip.reader["load"]
    assert loaded["num_cached_tokens"] >= 0.9 * PREFIX_LEN
    assert _report(loaded)["loaded_tokens"] == PREFIX_LEN // BLOCK_SIZE * BLOCK_SIZE
    assert _report(loaded)["failed_blocks"] == 0
    assert loaded["token_ids"] == roundtrip.reference["prompt"]["token_ids"]


def test_failed_loads_are_recomputed_with_identical_output(roundtrip: Roundtrip) -> None:
    corrupt = roundtrip.reader["corrupt"]
    assert _report(corrupt)["loaded_tokens"] > 0
    assert _report(corrupt)["failed_blocks"] > 0
    assert corrupt["token_ids"] == roundtrip.reference["prompt"]["token_ids"]

    # The recomputed blocks were saved again: the next run loads the whole prompt cleanly.
    healed = roundtrip.reader["healed"]
    assert _report(healed)["failed_blocks"] == 0
    assert _report(healed)["loaded_tokens"] == (len(roundtrip.prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert healed["token_ids"] == roundtrip.reference["prompt"]["token_ids"]


def test_kv_transfer_params_turn_loading_off(roundtrip: Roundtrip) -> None:
    no_load = roundtrip.reader["no_load"]
    assert _report(no_load)["loaded_tokens"] == 0
    assert no_load["num_cached_tokens"] == 0
    assert no_load["token_ids"] == roundtrip.reference["prompt"]["token_ids"]
