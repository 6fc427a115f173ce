"""One simulated engine: vLLM-style continuous batching with chunked prefill, decode and KV memory.

Each step the scheduler (as vLLM v1's) gives every decoding sequence one token,
then continues running prefills, then admits waiting requests in order while the
step's token budget lasts: a request whose KV is to be loaded (a routed pull, or
blocks only in the local CPU tier) starts its load and steps aside; one that needs
more KV blocks than are free (after evicting unpinned prefix-cache blocks) blocks
the queue. A step's time comes from :class:`~kvmesh_apps.replay.costs.StepCosts`
with log-normal noise. Decode-only stretches run as one macro step that an
arrival cuts short.

Memory: ``gpu_kv_blocks`` hold the prefix cache and the running sequences' own KV
(prompt blocks beyond the cache hit plus their output). Prompt blocks join the
prefix cache (pinned while used) when their prefill ends, and are offloaded to
the node's CPU tier over the GPU-to-host link (the simulation times the copy). Both tiers evict least-recently-used
blocks, and a chain's tail before its head: a finished sequence's blocks are
released tail first, as vLLM's free-block queue does.
"""

from __future__ import annotations

import collections
import enum
import math
from dataclasses import dataclass, field

from control_plane.routing.types import KvSource


class Tier:
    """An LRU of block hashes with pins; eviction takes the least recent unpinned block."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.pins: collections.Counter[bytes] = collections.Counter()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self._lru

    def leading(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def release(self, hashes: list[bytes]) -> None:
        """Marks a chain recently used, tail first (so its tail is evicted before its head)."""
        for h in reversed(hashes):
            if h in self._lru:
                self._lru.move_to_end(h)

    def insert(self, hashes: list[bytes]) -> list[bytes]:
        """Adds a chain (tail first); returns the hashes that were new."""
        new = []
        for h in reversed(hashes):
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
                new.append(h)
        return new

    def evict(self, count: int) -> list[bytes]:
        """Frees up to ``count`` unpinned blocks, least recent first."""
        out: list[bytes] = []
        for h in self._lru:
            if len(out) == count:
                break
            if not self.pins[h]:
                out.append(h)
        for h in out:
            del self._lru[h]
            self.pins.pop(h, None)
        return out

    def overflow(self) -> int:
        return max(0, len(self._lru) - self.capacity)


class Phase(enum.Enum):
    WAITING = 1    # queued, not yet examined by the scheduler
    LOADING = 2    # its KV is being pulled from a peer and/or promoted from the CPU tier
    READY = 3      # loaded; waiting to be admitted
    PREFILL = 4
    DECODE = 5


@dataclass(eq=False)
class Seq:
    """All state of one request on one engine."""

    arrival_ms: float
    prompt: int
    output: int
    hashes: list[bytes]
    source: KvSource | None
    planned: int                    # tokens to prefill as routed (what the engine reports as backlog)
    phase: Phase = Phase.WAITING
    loaded_blocks: int = 0          # leading blocks loaded into the local tiers (pull + promotion)
    cached: int = 0                 # tokens not prefilled (GPU hit + loaded)
    computed: int = 0               # tokens prefilled so far
    generated: int = 0
    private_blocks: int = 0         # GPU KV blocks of its own
    pinned: list[bytes] = field(default_factory=list)
    wait_ms: float = 0.0            # queue and load time before its prefill began
    pulling: int = 0                # blocks being pulled from the routed source
    examined_ms: float = 0.0        # when the scheduler first looked at it (a pull starts then)
    local_blocks: int = 0           # leading blocks its own tiers held then ...
    gpu_blocks: int = 0             # ... of which on the GPU

    @property
    def remaining_prefill(self) -> int:
        return self.prompt - self.cached - self.computed


class Engine:
    def __init__(self, index: int, node_id: str, gpu_blocks: int, cpu_blocks: int, block_tokens: int) -> None:
        self.index = index
        self.node_id = node_id
        self.gpu = Tier(gpu_blocks)
        self.cpu = Tier(cpu_blocks)
        self.block_tokens = block_tokens
        self.waiting: collections.deque[Seq] = collections.deque()
        self.loading: set[Seq] = set()
        self.running: list[Seq] = []
        self.private_blocks = 0
        self.busy = False
        self.step_version = 0
        self.pending_events: list = []     # (time_ms, kind, medium, hash): tier changes not yet published
        self.prefill_tokens = 0            # for the throughput report: tokens prefilled ...
        self.prefill_step_ms = 0.0         # ... in steps that prefilled

    def backlog(self) -> tuple[int, int]:
        """(waiting requests, prompt tokens still to prefill): what a scheduler sees of this engine."""
        queued = list(self.waiting) + list(self.loading)
        tokens = sum(s.planned for s in queued) + sum(s.remaining_prefill for s in self.running
                                                    if s.phase is Phase.PREFILL)
        return len(queued), tokens

    def free_blocks(self) -> int:
        return self.gpu.capacity - self.private_blocks - len(self.gpu)

    def blocks_of(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)
