"""Block identity: the chained block hashes vLLM computes, outside vLLM.

vLLM hashes each full block as ``hash_fn((parent or NONE_HASH, tuple(tokens),
extra_keys))`` where ``NONE_HASH = hash_fn(seed)`` and the seed is
``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"`` for the cryptographic
algorithms. Extra keys are tagged tuples: ``("lora", name, path)`` on every
block of a LoRA request and ``("cache_salt", salt)`` on the first block only.
Golden vectors produced by vLLM's own code pin this (tests/test_hashing.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, AsyncContextManager, AsyncIterator, Callable, Sequence

import cbor2

from kvmesh.errors import InvalidArgument

BLOCKS_PER_TURN = 1024  # blocks block_hashes_in_turns hashes between two turns of the event loop (~8 ms)
MAX_EXTRA_LEN = 1024  # characters of a LoRA name or path, or a cache salt

DEFAULT_SEED = "vllm-none-hash"


class HashAlgo(enum.Enum):
    """Block hash algorithms, with vLLM's names as values."""

    SHA256_CBOR = "sha256_cbor"
    SHA256 = "sha256"
    XXHASH_CBOR = "xxhash_cbor"

    @property
    def digest_size(self) -> int:
        return 16 if self is HashAlgo.XXHASH_CBOR else 32

    @property
    def needs_explicit_seed(self) -> bool:
        """Non-cryptographic hashes get a random per-process seed in vLLM unless one is set."""
        return self is HashAlgo.XXHASH_CBOR

    @classmethod
    def parse(cls, name: str) -> "HashAlgo":
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(a.value for a in cls)
            raise InvalidArgument(f"unknown hash algorithm {name!r}; choose one of {choices}") from None


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _xxhash_cbor(obj: Any) -> bytes:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise InvalidArgument("hash algorithm xxhash_cbor needs the 'xxhash' package") from exc
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_HASH_FNS: dict[HashAlgo, Callable[[Any], bytes]] = {
    HashAlgo.SHA256_CBOR: _sha256_cbor,
    HashAlgo.SHA256: _sha256_pickle,
    HashAlgo.XXHASH_CBOR: _xxhash_cbor,
}


@dataclass(frozen=True, slots=True)
class Extras:
    """Per-request inputs to the hash besides the tokens."""

    lora_name: str = ""
    lora_path: str = ""
    cache_salt: str = ""

    def validate(self) -> "Extras":
        for name in ("lora_name", "lora_path", "cache_salt"):
            if len(getattr(self, name)) > MAX_EXTRA_LEN:
                raise InvalidArgument(f"{name} is longer than {MAX_EXTRA_LEN} characters")
        return self

    def keys_for_block(self, index: int) -> tuple[Any, ...] | None:
        keys: list[tuple[str, ...]] = []
        if self.lora_name:
            keys.append(("lora", self.lora_name, self.lora_path))
        if index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None


class BlockHasher:
    """Computes chained block hashes for one algorithm and seed.

    Thread-safe: immutable after construction.
    """

    def __init__(self, algo: HashAlgo = HashAlgo.SHA256_CBOR, seed: str = "") -> None:
        self.algo = algo
        self._fn = _HASH_FNS[algo]
        if algo.needs_explicit_seed and not seed:
            raise InvalidArgument(
                f"{algo.value} needs an explicit hash_seed (vLLM's PYTHONHASHSEED); "
                "without one vLLM uses a random per-process seed and no block ever matches"
            )
        self.none_hash = self._fn(seed or DEFAULT_SEED)

    def block_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        extras: Extras = Extras(),
        parent: bytes | None = None,
        first_block: int = 0,
    ) -> list[bytes]:
        """Hashes of every full block of ``token_ids``; a trailing partial block is ignored. ``parent`` and
        ``first_block``: the hash and index of the block before them, when ``token_ids`` continue a prompt."""
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive, got {block_size}")
        hashes: list[bytes] = []
        prev = parent or self.none_hash
        for index in range(len(token_ids) // block_size):
            block = tuple(token_ids[index * block_size : (index + 1) * block_size])
            prev = self._fn((prev, block, extras.keys_for_block(first_block + index)))
            hashes.append(prev)
        return hashes

    async def block_hashes_in_turns(self, token_ids: Sequence[int], block_size: int, extras: Extras = Extras(),
                                    turn: AsyncContextManager = contextlib.nullcontext()) -> list[bytes]:
        """:meth:`block_hashes`, handing the event loop back after every :data:`BLOCKS_PER_TURN` blocks: a server
        hashing a lookup of 65,536 one-token blocks held its loop ~0.5 s at once (~8 us a block), so every
        other caller's request, heartbeat and event waited behind each such lookup in flight. ``turn``: held
        while hashing (a :meth:`CallerTurns.turn`, so that one caller's lookups hash one at a time)."""
        hashes: list[bytes] = []
        step = BLOCKS_PER_TURN * max(block_size, 1)
        async with turn:
            for start in range(0, len(token_ids), step):
                hashes += self.block_hashes(token_ids[start:start + step], block_size, extras,
                                            hashes[-1] if hashes else None, len(hashes))
                await asyncio.sleep(0)
        return hashes


class CallerTurns:
    """One hashing at a time per caller, the others queued in order. Turns alone are not fair: the loop runs
    every ready task in turn, so a key with 256 lookups in flight had 256 turns (~2 s) for each one of another
    key's; hashing one at a time per key, each key with hashing to do gets one turn per round."""

    def __init__(self) -> None:
        self._callers: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # key -> (its lock, [holders + waiters])

    @contextlib.asynccontextmanager
    async def turn(self, caller: str) -> AsyncIterator[None]:
        entry = self._callers.get(caller)
        if entry is None:  # a lock made only for a caller with none (every lookup by token ids comes here)
            entry = self._callers[caller] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._callers[caller]
