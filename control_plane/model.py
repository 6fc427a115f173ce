"""Domain types of the control plane: node registry, KV events, prefix matches.

The servicer converts protos into these (``control_plane.wire``) and back; the
core and the block-map backends only ever see these.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument
from kvmesh.namespace import Namespace, validate_node_id  # noqa: F401  (re-exported)

_ADDRESS_RE = re.compile(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]{1,253}):\d{1,5}")  # whole strings (fullmatch)
_POOL_RE = re.compile(r"[A-Za-z0-9_.:-]{0,128}")
MAX_LABELS = 32
MAX_LABEL_LEN = 256


class Medium(enum.IntEnum):
    """A tier of a node. Values equal the proto enum; ``bit`` is its block-map bit."""

    GPU = 1
    CPU = 2
    DISK = 3

    @property
    def bit(self) -> int:
        return 1 << (self.value - 1)


ALL_TIERS = Medium.GPU.bit | Medium.CPU.bit | Medium.DISK.bit


def tier_mask(media: "list[Medium] | tuple[Medium, ...]") -> int:
    """The bit mask of ``media``; empty means every tier."""
    mask = 0
    for medium in media:
        mask |= medium.bit
    return mask or ALL_TIERS


def validate_address(address: str, what: str = "data_plane_address") -> str:
    if not _ADDRESS_RE.fullmatch(address) or not 0 < int(address.rsplit(":", 1)[1]) < 65536:
        raise InvalidArgument(f"{what} {address!r} must be host:port")
    return address


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    data_plane_address: str
    pool: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    def validate(self) -> "NodeInfo":
        validate_node_id(self.node_id)
        validate_address(self.data_plane_address)
        if not _POOL_RE.fullmatch(self.pool):
            raise InvalidArgument(f"pool {self.pool[:64]!r} is not valid: up to 128 letters, digits, '_', '.', ':', '-'")
        if len(self.labels) > MAX_LABELS:
            raise InvalidArgument(f"{len(self.labels)} labels; the limit is {MAX_LABELS}")
        for k, v in self.labels.items():
            if not k or len(k) > MAX_LABEL_LEN or len(v) > MAX_LABEL_LEN:
                raise InvalidArgument(f"label {k[:64]!r}: keys must be 1-{MAX_LABEL_LEN} characters, values at most "
                                      f"{MAX_LABEL_LEN}")
        return self


@dataclass(frozen=True, slots=True)
class Registration:
    incarnation: int
    lease_ms: int
    next_seq: int = 1


@dataclass(frozen=True, slots=True)
class NodeStatus:
    node: NodeInfo
    incarnation: int
    live: bool
    last_seq: int
    lease_expires_unix_ms: int


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks stored on a tier of the node."""

    block_hashes: tuple[bytes, ...]
    medium: Medium
    block_size: int
    parent_block_hash: bytes = b""
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks removed from one tier (``medium=None``: every tier)."""

    block_hashes: tuple[bytes, ...]
    medium: Medium | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block of one tier (``medium=None``: every tier and namespace) dropped."""

    medium: Medium | None = None


Event = Stored | Removed | Cleared

# Each clear fences or sweeps every namespace the node holds blocks in (Redis scripts over the whole map), so a batch
# may carry only a few: 65,536 of them in a 256 KiB batch kept the control plane sweeping for minutes.
MAX_CLEARS_PER_BATCH = 16


@dataclass(frozen=True, slots=True)
class EventBatch:
    node_id: str
    incarnation: int
    seq: int
    namespace: Namespace
    events: tuple[Event, ...]
    reset: bool = False

    @property
    def block_count(self) -> int:
        return sum(len(e.block_hashes) for e in self.events if not isinstance(e, Cleared))

    def validate(self, max_blocks: int) -> "EventBatch":
        """Checks everything a backend relies on; raises InvalidArgument saying what is wrong."""
        validate_node_id(self.node_id)
        if self.incarnation <= 0:
            raise InvalidArgument("incarnation must be set (from RegisterNode)")
        if self.seq <= 0:
            raise InvalidArgument("seq must start at 1")
        if not self.events and not self.reset:
            raise InvalidArgument("empty event batch")
        if self.block_count > max_blocks:
            raise InvalidArgument(f"batch carries {self.block_count} blocks; the limit is {max_blocks}")
        clears = sum(isinstance(e, Cleared) for e in self.events)
        if clears > MAX_CLEARS_PER_BATCH:
            raise InvalidArgument(f"batch clears {clears} times; the limit is {MAX_CLEARS_PER_BATCH} (send the rest "
                                  "in later batches)")
        cfg = self.namespace.cache_config
        digest = cfg.hash_algo.digest_size
        for i, event in enumerate(self.events):
            if isinstance(event, Cleared):
                continue
            if not event.block_hashes:
                raise InvalidArgument(f"event {i} has no block hashes")
            for h in event.block_hashes:
                if len(h) != digest:
                    raise InvalidArgument(
                        f"event {i}: block hash of {len(h)} bytes; {cfg.hash_algo.value} hashes are {digest} bytes"
                    )
            if isinstance(event, Stored):
                if event.block_size != cfg.block_size:
                    raise InvalidArgument(
                        f"event {i}: block_size {event.block_size} does not match the namespace's "
                        f"block size {cfg.block_size}"
                    )
                if event.token_ids and len(event.token_ids) != cfg.block_size * len(event.block_hashes):
                    raise InvalidArgument(
                        f"event {i}: {len(event.token_ids)} token ids for {len(event.block_hashes)} blocks "
                        f"of {cfg.block_size} tokens"
                    )
        return self


class AckStatus(enum.Enum):
    APPLIED = 1
    DUPLICATE = 2
    RESYNC_REQUIRED = 3
    REFUSED = 4


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int
    status: AckStatus
    expected_seq: int = 0
    blocks_applied: int = 0
    detail: str = ""


class PackedHashes(Sequence[bytes]):
    """Block hashes of ``size`` bytes each, concatenated in chain order (``LookupPrefixRequest.packed_block_hashes``):
    a sequence of ``bytes`` like a list of hashes, whose ``blob`` lookups use as is (no Python object per hash)."""

    __slots__ = ("blob", "size")

    def __init__(self, blob: bytes, size: int) -> None:
        self.blob = blob
        self.size = size

    def validate(self, algo_name: str) -> "PackedHashes":
        if len(self.blob) % self.size:
            raise InvalidArgument(f"packed_block_hashes has {len(self.blob)} bytes, not a multiple of the "
                                  f"{self.size}-byte {algo_name} hash; send whole hashes, concatenated")
        return self

    def __len__(self) -> int:
        return len(self.blob) // self.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.blob[i * self.size:(i + 1) * self.size]


def joined(block_hashes: Sequence[bytes]) -> bytes:
    """The hashes concatenated (a :class:`PackedHashes`' blob as is)."""
    return block_hashes.blob if isinstance(block_hashes, PackedHashes) else b"".join(block_hashes)


@dataclass(frozen=True, slots=True)
class NodePrefix:
    """How many leading blocks of the query a node holds: on any counted tier and per tier."""

    node_id: str
    data_plane_address: str
    leading_blocks: int
    per_tier: dict[Medium, int]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    blocks_queried: int
    holders: list[NodePrefix]
    block_hashes: list[bytes] = field(default_factory=list)  # set when the server hashed tokens

    @property
    def longest(self) -> int:
        return self.holders[0].leading_blocks if self.holders else 0
