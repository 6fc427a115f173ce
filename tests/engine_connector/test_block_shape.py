"""EngineBlocks.check: the startup error when the node's data-plane slots are not one engine block."""

from __future__ import annotations

import pytest

from engine_connector.block_shape import EngineBlocks, SlotSizeMismatch

ENGINE = EngineBlocks(64, "/models/m", "bfloat16")


def test_slots_of_one_block_pass() -> None:
    ENGINE.check("dp:1", 24576, 24576)
    ENGINE.check("dp:1", 24576, 24576, slot_tokens=64)


def test_other_bytes_name_the_engines_block_and_both_remedies() -> None:
    with pytest.raises(SlotSizeMismatch) as refused:
        ENGINE.check("dp:1", 2097152, 24576)
    message = str(refused.value)
    assert "the data plane at dp:1 has 2097152-byte slots but this engine's KV blocks are 24576 bytes" in message
    assert "`kvmesh up --block-bytes 24576 --block-tokens 64`" in message
    assert "`kvmesh up --model /models/m --dtype bfloat16 --block-tokens 64`" in message
    assert "KVMESH_DP_BLOCK_BYTES=24576 KVMESH_DP_BLOCK_TOKENS=64" in message


def test_equal_bytes_in_blocks_of_other_tokens_are_refused_too() -> None:
    # 2 MiB per 32-token block on the node, 2 MiB per 64-token block in the engine: every request would be refused.
    with pytest.raises(SlotSizeMismatch, match="2097152-byte slots of 32-token blocks .* 2097152 bytes \\(64 tokens"):
        ENGINE.check("dp:1", 2097152, 2097152, slot_tokens=32)


def test_the_kv_cache_dtype_is_named_when_not_auto() -> None:
    with pytest.raises(SlotSizeMismatch, match="--dtype bfloat16 --kv-cache-dtype fp8 --block-tokens 64`"):
        EngineBlocks(64, "/m", "bfloat16", "fp8").check("dp:1", 1, 2)


def test_an_engine_whose_blocks_are_split_over_workers_is_refused_in_one_line():
    """Found in review: with --tensor-parallel-size 2 each worker saved its half of a block's KV heads under the
    same hashes into the node's one slot (the second refused), and a load copied the first worker's heads into
    both: wrong KV, nothing reported. Control: one worker."""
    from types import SimpleNamespace

    def config(**parallel):
        return SimpleNamespace(parallel_config=SimpleNamespace(**parallel),
                               model_config=SimpleNamespace(model="/m", dtype="torch.bfloat16"),
                               cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"))

    assert EngineBlocks.of(config(tensor_parallel_size=1, pipeline_parallel_size=1)) == EngineBlocks(32, "/m",
                                                                                                     "bfloat16")
    for parallel in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                     {"tensor_parallel_size": 1, "decode_context_parallel_size": 4}):
        with pytest.raises(ValueError) as refused:
            EngineBlocks.of(config(**parallel))
        message = str(refused.value)
        assert "\n" not in message and "one worker per engine only" in message
        assert ", ".join(f"{k}={v}" for k, v in parallel.items() if v > 1) in message
