"""Domain types of the Route RPC and of stats reports (``wire`` converts protos to these)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument
from kvmesh.hashing import Extras
from kvmesh.namespace import Namespace

from control_plane.model import Medium, validate_node_id

MAX_CANDIDATES = 1024
# Bytes of KV cache per token, at most: 16x a 405B-parameter model's in 16 bits (126 layers x 8 KV heads x 128 x 2 x 2
# bytes = 504 KiB). A figure past it is a mistake, or made up to make every pull look costly.
MAX_KV_BYTES_PER_TOKEN = 16 << 20
MAX_REPORT_SAMPLES = 10_000
# The most a reported figure may say (ReportStats). Past these it is a mistake or made up: a node reporting its own
# engine at 1e300 tokens/s made its queue of 200,000 tokens look free, and took other tenants' routes.
MAX_PREFILL_TOKENS_PER_S = 1e8   # 100 M tokens/s: ~100x the prefill of any engine (one GPU, or a whole node) today
MAX_LINK_BYTES_PER_S = 1e12      # 1 TB/s: more than a node's NICs together (8 x 400 Gb/s = 400 GB/s) carry
MAX_PULL_BLOCKS = 1 << 24        # blocks one routed pull names: far more than a prompt's


class Policy(enum.Enum):
    """Placement policies; values equal the proto enum."""

    AFFINITY = 1
    LOAD_AWARE = 2
    TOKEN_AWARE = 3
    COST_AWARE = 4

    @property
    def label(self) -> str:
        """``affinity``, ``load-aware``, ``token-aware``, ``cost-aware``."""
        return self.name.lower().replace("_", "-")

    @classmethod
    def from_label(cls, label: str) -> "Policy":
        for policy in cls:
            if policy.label == label:
                return policy
        raise InvalidArgument(f"unknown policy {label!r}: one of {', '.join(p.label for p in cls)}")


class Reason(enum.Enum):
    """Why the engine was chosen; values equal the proto enum."""

    LONGEST_LOCAL_PREFIX = 1
    LEAST_LOADED = 2
    FEWEST_TOKENS_TO_PREFILL = 3
    LOWEST_ESTIMATED_TTFT = 4


class SourceDecision(enum.Enum):
    """Whether a KV source was named, and why not; values equal the proto enum."""

    PULL = 1
    NONE_AHEAD = 2
    BELOW_MIN_DELTA = 3
    RECOMPUTE_CHEAPER = 4
    P2P_DISABLED = 5


@dataclass(frozen=True, slots=True)
class Candidate:
    """An engine the request may run on, its co-located data-plane node and its load."""

    engine_id: str
    node_id: str
    waiting_requests: int = 0
    running_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    namespace: Namespace
    candidates: tuple[Candidate, ...]
    block_hashes: tuple[bytes, ...] = ()
    token_ids: tuple[int, ...] = ()
    extras: Extras = field(default_factory=Extras)
    prompt_tokens: int = 0            # with block_hashes; 0: blocks * block_size
    policy: Policy | None = None      # None: the server's default
    p2p: bool = True
    min_cached_token_delta: int = 0   # 0: the server's default
    kv_bytes_per_token: int = 0       # 0: the server's default
    kv_request_id: str = ""
    prefetch: bool = True             # False: the scheduler opts this request out of route-time prefetch

    def validate(self) -> "RouteRequest":
        """Raises InvalidArgument saying what is wrong (hash lengths are checked by the lookup)."""
        if not self.candidates:
            raise InvalidArgument("route needs at least one candidate engine")
        if len(self.candidates) > MAX_CANDIDATES:
            raise InvalidArgument(f"{len(self.candidates)} candidates; the limit is {MAX_CANDIDATES}")
        seen: set[str] = set()
        for i, c in enumerate(self.candidates):
            try:
                validate_node_id(c.engine_id)
                validate_node_id(c.node_id)
            except InvalidArgument as exc:
                raise InvalidArgument(f"candidates[{i}]: {exc}") from None
            if c.engine_id in seen:
                raise InvalidArgument(f"candidates[{i}]: duplicate engine_id {c.engine_id!r}")
            seen.add(c.engine_id)
            if c.waiting_requests < 0 or c.running_tokens < 0:
                raise InvalidArgument(
                    f"candidates[{i}] ({c.engine_id}): waiting_requests and running_tokens must be >= 0")
        if self.block_hashes and self.token_ids:
            raise InvalidArgument("give block_hashes or token_ids, not both")
        if not self.block_hashes and not self.token_ids and not self.prompt_tokens:
            raise InvalidArgument("the prompt is empty: give token_ids, or block_hashes and/or prompt_tokens")
        if self.token_ids and self.prompt_tokens:
            raise InvalidArgument("prompt_tokens goes with block_hashes; with token_ids the length is known")
        covered = len(self.block_hashes) * self.namespace.cache_config.block_size
        if self.block_hashes and self.prompt_tokens and self.prompt_tokens < covered:
            raise InvalidArgument(
                f"prompt_tokens {self.prompt_tokens} is shorter than the {covered} tokens its "
                f"{len(self.block_hashes)} full blocks cover")
        if self.kv_bytes_per_token > MAX_KV_BYTES_PER_TOKEN:
            raise InvalidArgument(f"kv_bytes_per_token {self.kv_bytes_per_token} is more than {MAX_KV_BYTES_PER_TOKEN} "
                                  "(16 MiB): give the model's KV bytes per token (layers x KV heads x head size x 2 x "
                                  "bytes per element), or 0 for the server's default")
        if self.kv_request_id and len(self.kv_request_id) > 256:
            raise InvalidArgument("kv_request_id is longer than 256 characters")
        return self

    @property
    def prompt_length(self) -> int:
        if self.token_ids:
            return len(self.token_ids)
        return self.prompt_tokens or len(self.block_hashes) * self.namespace.cache_config.block_size


@dataclass(frozen=True, slots=True)
class KvSource:
    """A peer to pull the prefix from: ``kv_transfer_params.remote_kv_source``, typed."""

    node_id: str
    host: str
    port: int
    tier: Medium
    cached_tokens: int
    kv_request_id: str = ""
    route_token: str = ""  # the control plane's signature on this source (tenancy.grants.RouteToken)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def to_transfer_params(self) -> dict:
        """The ``remote_kv_source`` dict an engine takes in ``kv_transfer_params``."""
        out: dict = {}
        if self.kv_request_id:
            out["kv_request_id"] = self.kv_request_id
        out.update(remote_host=self.host, remote_port=self.port, remote_node_id=self.node_id,
                   tier=self.tier.name, cached_tokens=self.cached_tokens)
        if self.route_token:
            out["route_token"] = self.route_token
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_transfer_params(), sort_keys=True)


@dataclass(frozen=True, slots=True)
class PrefetchOrder:
    """Route's signed order for the chosen engine's data plane to start the decided pull now
    (``DataPlane.Prefetch``; docs/scheduling.md#prefetch-at-route-time)."""

    node_id: str
    data_plane_address: str
    ticket: str  # tenancy.grants.PrefetchTicket, signed
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Estimate:
    """The cost model's time to first token for one option, in milliseconds."""

    queue_ms: float = 0.0
    lookup_ms: float = 0.0
    transfer_ms: float = 0.0
    promotion_ms: float = 0.0
    prefill_ms: float = 0.0

    @property
    def ttft_ms(self) -> float:
        return self.queue_ms + self.lookup_ms + self.transfer_ms + self.promotion_ms + self.prefill_ms


@dataclass(frozen=True, slots=True)
class RouteDecision:
    engine_id: str
    reason: Reason
    source_decision: SourceDecision
    prompt_tokens: int
    local_cached_tokens: int
    estimate: Estimate
    source: KvSource | None = None
    prefetch: PrefetchOrder | None = None  # set by the control plane with a PULL, unless off or opted out
    prefetch_status: str = ""  # SchedulerClient: the destination's answer to the order ("": none handed over)

    def kv_transfer_params(self) -> dict:
        """``{"remote_kv_source": {...}}`` when a source was named, else ``{}``."""
        return {"remote_kv_source": self.source.to_transfer_params()} if self.source else {}

    @property
    def explanation(self) -> str:
        text = (f"{self.engine_id}: {self.reason.name.lower()}, {self.local_cached_tokens}/{self.prompt_tokens} "
                f"tokens cached locally")
        if self.source is not None:
            text += f"; pull {self.source.cached_tokens} tokens from {self.source.node_id}"
        else:
            text += f"; no pull ({self.source_decision.name.lower()})"
        return text + f"; estimated TTFT {self.estimate.ttft_ms:.1f} ms"


@dataclass(frozen=True, slots=True)
class LinkSample:
    source_node_id: str
    dest_node_id: str
    bytes_per_s: float


@dataclass(frozen=True, slots=True)
class EngineSample:
    engine_id: str
    prefill_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class PullOutcome:
    source_node_id: str
    blocks_routed: int
    blocks_hit: int

    @property
    def stale(self) -> bool:
        """The source no longer held every block the route promised."""
        return self.blocks_hit < self.blocks_routed


@dataclass(frozen=True, slots=True)
class StatsReport:
    links: tuple[LinkSample, ...] = ()
    engines: tuple[EngineSample, ...] = ()
    pulls: tuple[PullOutcome, ...] = ()

    def validate(self) -> "StatsReport":
        total = len(self.links) + len(self.engines) + len(self.pulls)
        if total > MAX_REPORT_SAMPLES:
            raise InvalidArgument(f"{total} samples in one report; the limit is {MAX_REPORT_SAMPLES}")
        for i, s in enumerate(self.links):
            validate_node_id(s.source_node_id)
            validate_node_id(s.dest_node_id)
            if not 0 < s.bytes_per_s <= MAX_LINK_BYTES_PER_S:  # NaN fails it too
                raise InvalidArgument(f"links[{i}]: bytes_per_s must be > 0 and at most {MAX_LINK_BYTES_PER_S:g} "
                                      f"(1 TB/s, more than any link carries), not {s.bytes_per_s!r}")
        for i, e in enumerate(self.engines):
            validate_node_id(e.engine_id)
            if not 0 < e.prefill_tokens_per_s <= MAX_PREFILL_TOKENS_PER_S:
                raise InvalidArgument(f"engines[{i}]: prefill_tokens_per_s must be > 0 and at most "
                                      f"{MAX_PREFILL_TOKENS_PER_S:g} (more than any engine prefills), "
                                      f"not {e.prefill_tokens_per_s!r}")
        for i, p in enumerate(self.pulls):
            validate_node_id(p.source_node_id)
            if not 0 <= p.blocks_routed <= MAX_PULL_BLOCKS or p.blocks_hit < 0:
                raise InvalidArgument(f"pulls[{i}]: blocks_routed and blocks_hit must be 0 to {MAX_PULL_BLOCKS}")
            if p.blocks_hit > p.blocks_routed:
                raise InvalidArgument(f"pulls[{i}]: blocks_hit exceeds blocks_routed")
        return self
