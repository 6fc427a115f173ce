"""Block identity: kvmesh computes exactly the chained block hashes vLLM computes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.hashing import BlockHasher, Extras, HashAlgo
from kvmesh.namespace import CacheConfig, Namespace

GOLDEN = Path(__file__).parent / "data" / "golden_block_hashes.json"
TOKENS = list(range(100, 170))  # 2 full blocks of 32 and a partial one


def _ours(algo: str, seed: str | None, salt: str) -> list[str]:
    hasher = BlockHasher(HashAlgo(algo), seed or "")
    return [h.hex() for h in hasher.block_hashes(TOKENS, 32, Extras(cache_salt=salt))]


@pytest.mark.parametrize("key", sorted(json.loads(GOLDEN.read_text())))
def test_golden_vectors_recorded_from_vllm(key):
    algo, seed, extras = key.split("|")
    expected = json.loads(GOLDEN.read_text())[key]
    assert _ours(algo, None if seed == "None" else seed, "salt" if extras == "salt" else "") == expected


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_golden_vectors_still_match_the_installed_vllm():
    """Regenerates the vectors with vLLM's own hashing code (in a clean process: it reads PYTHONHASHSEED)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "vllm_golden_hashes.py")], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert json.loads(out) == json.loads(GOLDEN.read_text())


def test_lora_and_salt_change_every_hash_they_should():
    plain = BlockHasher().block_hashes(TOKENS, 32)
    salted = BlockHasher().block_hashes(TOKENS, 32, Extras(cache_salt="s"))
    lora = BlockHasher().block_hashes(TOKENS, 32, Extras(lora_name="a", lora_path="/p"))
    assert all(a != b for a, b in zip(plain, salted))  # the salt is in block 0, which every later hash chains
    assert all(a != b for a, b in zip(plain, lora))
    assert len(plain) == 2  # the partial block is not hashed


def test_parent_continues_a_chain():
    hasher = BlockHasher()
    full = hasher.block_hashes(TOKENS[:64], 32)
    assert hasher.block_hashes(TOKENS[32:64], 32, parent=full[0]) == full[1:]


def test_bad_inputs():
    with pytest.raises(InvalidArgument, match="needs an explicit hash_seed"):
        BlockHasher(HashAlgo.XXHASH_CBOR)
    with pytest.raises(InvalidArgument, match="unknown hash algorithm"):
        HashAlgo.parse("md5")
    with pytest.raises(InvalidArgument, match="block_size must be positive"):
        BlockHasher().block_hashes(TOKENS, 0)


def test_namespace_fingerprint_separates_every_field():
    base = Namespace("acme", "m", "v1", CacheConfig(32))
    variants = [
        Namespace("other", "m", "v1", CacheConfig(32)), Namespace("acme", "m2", "v1", CacheConfig(32)),
        Namespace("acme", "m", "v2", CacheConfig(32)), Namespace("acme", "m", "v1", CacheConfig(64)),
        Namespace("acme", "m", "v1", CacheConfig(32, kv_dtype="fp8")),
        Namespace("acme", "m", "v1", CacheConfig(32, kv_layout="HND")),
        Namespace("acme", "m", "v1", CacheConfig(32, parallel_layout="tp2-pp1")),
        Namespace("acme", "m", "v1", CacheConfig(32, hash_algo=HashAlgo.SHA256)),
        Namespace("acme", "m", "v1", CacheConfig(32, hash_seed="1")),
    ]
    prints = {base.fingerprint, *(v.fingerprint for v in variants)}
    assert len(prints) == len(variants) + 1
    assert Namespace.from_proto(base.to_proto()) == base


@pytest.mark.parametrize("block_size,blocks", [(1, 3000), (16, 2049), (32, 1024), (32, 1)])
async def test_hashing_in_turns_gives_the_same_chain(block_size, blocks):
    """Hashed a turn (1,024 blocks) at a time: the same hashes, across turns, with the salt in block 0 only and
    the LoRA in every block, and a trailing partial block left out."""
    tokens = list(range(block_size * blocks + block_size // 2))
    for extras in (Extras(), Extras(cache_salt="s", lora_name="a", lora_path="/p")):
        assert await BlockHasher().block_hashes_in_turns(tokens, block_size, extras) == \
            BlockHasher().block_hashes(tokens, block_size, extras)
