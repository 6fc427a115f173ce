"""Namespaces: what a KV block is valid for.

A block computed for one tenant, model, weight version and cache configuration
is meaningless (or a leak) anywhere else, so every key kvmesh stores or looks
up is scoped by a :class:`Namespace`. Two namespaces that differ in any field
have different fingerprints and therefore never share a key.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

from kvmesh.errors import InvalidArgument, clipped
from kvmesh.hashing import BlockHasher, HashAlgo
from kvmesh.v1 import common_pb2 as pb

_TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")  # whole strings (fullmatch)
_NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
MAX_BLOCK_SIZE = 4096
MAX_FIELD_LEN = 256

_ALGO_FROM_PB = {
    pb.HASH_ALGO_UNSPECIFIED: HashAlgo.SHA256_CBOR,
    pb.HASH_ALGO_SHA256_CBOR: HashAlgo.SHA256_CBOR,
    pb.HASH_ALGO_SHA256: HashAlgo.SHA256,
    pb.HASH_ALGO_XXHASH_CBOR: HashAlgo.XXHASH_CBOR,
}
_ALGO_TO_PB = {
    HashAlgo.SHA256_CBOR: pb.HASH_ALGO_SHA256_CBOR,
    HashAlgo.SHA256: pb.HASH_ALGO_SHA256,
    HashAlgo.XXHASH_CBOR: pb.HASH_ALGO_XXHASH_CBOR,
}


def valid_tenant(tenant: object) -> bool:
    return isinstance(tenant, str) and _TENANT_RE.fullmatch(tenant) is not None


def validate_tenant(tenant: str) -> str:
    if not valid_tenant(tenant):
        raise InvalidArgument(
            f"tenant {clipped(repr(tenant), 80)} is not a valid tenant id: 1-63 characters of a-z, 0-9, '_', '.', '-', "
            "starting with a letter or digit"
        )
    return tenant


def validate_node_id(node_id: str) -> str:
    if not _NODE_ID_RE.fullmatch(node_id):
        raise InvalidArgument(
            f"node_id {clipped(repr(node_id), 140)} is not valid: 1-128 characters of letters, digits, '_', '.', ':', "
            "'-'"
        )
    return node_id


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Everything two engines must share for a block to be reusable between them."""

    block_size: int
    kv_dtype: str = "bfloat16"
    kv_layout: str = ""
    parallel_layout: str = "tp1-pp1"
    hash_algo: HashAlgo = HashAlgo.SHA256_CBOR
    hash_seed: str = ""

    def validate(self) -> "CacheConfig":
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise InvalidArgument(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {self.block_size}")
        for name in ("kv_dtype", "kv_layout", "parallel_layout", "hash_seed"):
            if len(getattr(self, name)) > MAX_FIELD_LEN:
                raise InvalidArgument(f"cache_config.{name} is longer than {MAX_FIELD_LEN} characters")
        if self.hash_algo.needs_explicit_seed and not self.hash_seed:
            raise InvalidArgument(f"hash_algo {self.hash_algo.value} needs an explicit hash_seed")
        return self

    def hasher(self) -> BlockHasher:
        return BlockHasher(self.hash_algo, self.hash_seed)


@functools.lru_cache(maxsize=4096)  # asked for once per block on hot paths; a namespace never changes
def _fingerprint(ns: "Namespace") -> str:
    c = ns.cache_config
    fields = (
        ns.tenant, ns.model, ns.weight_version, str(c.block_size), c.kv_dtype, c.kv_layout,
        c.parallel_layout, c.hash_algo.value, c.hash_seed,
    )
    return hashlib.sha256("\x1f".join(fields).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Namespace:
    """Tenant + model + weights + cache configuration."""

    tenant: str
    model: str
    weight_version: str
    cache_config: CacheConfig

    def validate(self) -> "Namespace":
        validate_tenant(self.tenant)
        if not self.model:
            raise InvalidArgument("namespace.model must be set")
        for name in ("model", "weight_version"):
            if len(getattr(self, name)) > MAX_FIELD_LEN:
                raise InvalidArgument(f"namespace.{name} is longer than {MAX_FIELD_LEN} characters")
        self.cache_config.validate()
        return self

    @property
    def fingerprint(self) -> str:
        """16 hex digits identifying the namespace; part of every key for it."""
        return _fingerprint(self)

    @classmethod
    def from_proto(cls, msg: pb.Namespace) -> "Namespace":
        """The validated namespace; InvalidArgument when it is not valid."""
        c = msg.cache_config
        return _from_fields(msg.tenant, msg.model, msg.weight_version, c.block_size, c.kv_dtype, c.kv_layout,
                            c.parallel_layout, c.hash_algo, c.hash_seed)

    def to_proto(self) -> pb.Namespace:
        c = self.cache_config
        return pb.Namespace(
            tenant=self.tenant,
            model=self.model,
            weight_version=self.weight_version,
            cache_config=pb.CacheConfig(
                block_size=c.block_size,
                kv_dtype=c.kv_dtype,
                kv_layout=c.kv_layout,
                parallel_layout=c.parallel_layout,
                hash_algo=_ALGO_TO_PB[c.hash_algo],
                hash_seed=c.hash_seed,
            ),
        )


@functools.lru_cache(maxsize=4096)  # every RPC names one; a valid namespace is immutable (errors are not cached)
def _from_fields(tenant: str, model: str, weight_version: str, block_size: int, kv_dtype: str, kv_layout: str,
                 parallel_layout: str, hash_algo: int, hash_seed: str) -> Namespace:
    if hash_algo not in _ALGO_FROM_PB:
        raise InvalidArgument(f"unknown hash_algo enum value {hash_algo}")
    return Namespace(tenant, model, weight_version, CacheConfig(block_size, kv_dtype, kv_layout, parallel_layout,
                                                                _ALGO_FROM_PB[hash_algo], hash_seed)).validate()


# The byte layout of one block in a data-plane slot (engine_connector/kv_layout.py): every layer's rows of one
# vLLM paged block, concatenated. Bumped when that layout changes.
ENGINE_KV_LAYOUT = "vllm-paged-all-layers-v1"
VLLM_DEFAULT_HASH_ALGO = "sha256"  # vLLM's --prefix-caching-hash-algo default


def engine_namespace(model: str, *, block_size: int, kv_dtype: str, tenant: str = "default",
                     weight_version: str = "", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                     hash_algo: str | HashAlgo = VLLM_DEFAULT_HASH_ALGO, hash_seed: str = "") -> Namespace:
    """The namespace a vLLM engine's blocks are published under: the one rule the engine connector and
    ``kvmesh vllm-events`` follow, and a scheduler's way to look them up (``SchedulerClient.namespace_for``).

    ``model``: the engine's served model name (``--served-model-name``, else the model exactly as given to
    ``vllm serve``), unless the connector's ``model`` key overrides it. ``block_size``: ``--block-size``.
    ``kv_dtype``: ``--kv-cache-dtype`` if not ``auto``, else the dtype the engine serves in (``--dtype``
    resolved, e.g. ``bfloat16``, no ``torch.`` prefix). ``hash_algo``: ``--prefix-caching-hash-algo``.
    ``hash_seed``: the engine's ``PYTHONHASHSEED`` (empty when unset). ``tenant`` and ``weight_version``:
    the connector's keys of the same names. InvalidArgument when a field is not valid."""
    algo = hash_algo if isinstance(hash_algo, HashAlgo) else HashAlgo.parse(hash_algo)
    return Namespace(tenant, str(model), weight_version, CacheConfig(
        block_size=block_size, kv_dtype=kv_dtype.removeprefix("torch."), kv_layout=ENGINE_KV_LAYOUT,
        parallel_layout=f"tp{tensor_parallel_size}-pp{pipeline_parallel_size}", hash_algo=algo,
        hash_seed=hash_seed)).validate()
