"""Domain types of the data plane: block keys, tiers, lookup outcomes, tier filters.

Everything that crosses a module boundary inside the data plane is one of
these (never a proto message or an untyped dict); :mod:`data_plane.wire`
converts to and from protos at the gRPC edge.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import repeat
from typing import Iterable, NamedTuple

from kvmesh.errors import InvalidArgument
from kvmesh.namespace import Namespace
from kvmesh.v1 import common_pb2


class Medium(enum.IntEnum):
    """A tier of a node; values are ``kvmesh.v1.Medium`` (what the publisher takes)."""

    CPU = common_pb2.MEDIUM_CPU
    DISK = common_pb2.MEDIUM_DISK


class Locality(enum.Enum):
    LOCAL = "local"  # this node's own tiers
    PEER = "peer"  # another node's tiers, reached with a Pull


class LookupStatus(enum.Enum):
    """What a Lookup answers per block. HIT_PENDING only exists while waiting."""

    HIT = "hit"
    MISS = "miss"
    HIT_PENDING = "hit_pending"


class BlockKey(NamedTuple):
    """A block's identity on a node: namespace fingerprint + block hash."""

    namespace: str
    block_hash: bytes


def block_keys(fingerprint: str, hashes: Iterable[bytes]) -> list[BlockKey]:
    """``BlockKey(fingerprint, h)`` for each hash, built in a native loop (a third of the calls' cost)."""
    return list(map(tuple.__new__, repeat(BlockKey), zip(repeat(fingerprint), hashes)))


@dataclass(frozen=True, slots=True)
class TierFilter:
    """Which secondary tiers one request may load from (vLLM's ``kv_load_tiers``).

    The node's CPU tier is always allowed: it is the promotion target of every
    path. The filter restricts the local disk tier and peers' tiers.
    """

    allowed: frozenset[tuple[Medium, Locality]]

    @classmethod
    def everything(cls) -> "TierFilter":
        return cls(frozenset((m, loc) for m in Medium for loc in Locality))

    @classmethod
    def parse(cls, spec: str | Iterable[str]) -> "TierFilter":
        """From ``"cpu:local,disk:local,cpu:peer"`` (or a list of such items)."""
        items = [s for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
        allowed = set()
        for item in items:
            medium, _, locality = item.strip().lower().partition(":")
            try:
                allowed.add((Medium[medium.upper()], Locality(locality or "local")))
            except (KeyError, ValueError):
                raise InvalidArgument(
                    f"tier {item!r} is not MEDIUM:LOCALITY with MEDIUM in cpu, disk and LOCALITY in local, peer"
                ) from None
        return cls(frozenset(allowed))

    def allows(self, medium: Medium, locality: Locality) -> bool:
        return (medium is Medium.CPU and locality is Locality.LOCAL) or (medium, locality) in self.allowed

    def media(self, locality: Locality) -> frozenset[Medium]:
        return frozenset(m for m in Medium if self.allows(m, locality))


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    """A settled Lookup: per requested hash HIT or MISS, plus what a reader needs for the HITs."""

    statuses: list[LookupStatus]
    addrs: list[int]  # address of each HIT in the serving node's registered memory (-1 for a MISS)
    checksums: list[int]  # CRC-32C of each HIT (0 for a MISS)
    lease_id: str  # "" when nothing was pinned


@dataclass(frozen=True, slots=True)
class PullResult:
    statuses: list[LookupStatus]  # per requested hash: HIT (committed here now) or MISS
    pulled: int  # leading blocks committed here now that were not before the pull
    already_local: int  # leading blocks that were committed here before the pull
    bytes_pulled: int  # bytes this pull moved from the source (not those of joined blocks)
    lookup_ms: float
    transfer_ms: float
    joined: int = 0  # of ``pulled``: blocks another in-flight pull on this node brought (coalesced)
    refused: str = ""  # why the pull was refused before any transfer ("" when it was not)
    slots: list[int] = field(default_factory=list)  # with a lease: the leading blocks' slots, pinned (as Acquire)
    lease_id: str = ""
    checked: tuple = ()  # the tier's records of the blocks this pull checked and committed (not on the wire)


def validate_hashes(ns: Namespace, hashes: list[bytes], max_hashes: int) -> list[bytes]:
    """Checks a request's block hashes: count, digest size, no duplicates."""
    if len(hashes) > max_hashes:
        raise InvalidArgument(f"{len(hashes)} block hashes in one request; at most {max_hashes} are allowed")
    size = ns.cache_config.hash_algo.digest_size
    if hashes and set(map(len, hashes)) != {size}:
        i, h = next((i, h) for i, h in enumerate(hashes) if len(h) != size)
        raise InvalidArgument(
            f"block_hashes[{i}] has {len(h)} bytes; {ns.cache_config.hash_algo.value} hashes have {size}"
        )
    if len(set(hashes)) != len(hashes):
        raise InvalidArgument("block_hashes contains duplicates")
    return hashes
