"""Where reported figures live, so every control-plane replica routes on the same numbers.

Implementor contracts
- ``report`` folds samples into a per-link / per-engine moving average
  (weight ``alpha`` for the new sample) atomically: concurrent reports from
  several replicas each count once.
- ``figures`` returns a snapshot no older than ``refresh_ms``; a new instance
  over the same store returns the same figures (persistence, replicas).

Threading model: coroutines, safe to call concurrently on one event loop.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path

import redis.exceptions

from kvmesh.redis_client import connect

from control_plane.routing.cost_model import Figures
from control_plane.routing.types import StatsReport

_LINK_SEP = ">"  # node ids never contain it
_EWMA_LUA = (Path(__file__).parent.parent / "lua" / "stats_ewma.lua").read_text()
# Links and engines each hash keeps: a new one past this is not recorded (the cost model uses its defaults for it).
# Unbounded, a node reporting made-up engine names ("<node>:<anything>") grew both Redis and every route's read.
# Each node also has a share of it (``max_per_node``, stats_ewma.lua), so one node cannot fill it for the others.
MAX_FIGURES = 16_384
# One report moves a figure by at most this factor (stats_ewma.lua), whatever it says and however many samples of the
# figure it carries: a single made-up sample (within types.MAX_* bounds) no longer takes a node's figure there at once.
MAX_STEP = 4.0


class StatsStore(ABC):
    @abstractmethod
    async def report(self, report: StatsReport, reporter: str = "") -> None:
        """Folds a validated report's link and engine samples into the averages; ``reporter``: the node whose
        share of the figures its engines count against (default: the node each engine id names)."""

    @abstractmethod
    async def figures(self) -> Figures:
        """The current averages."""

    @abstractmethod
    async def close(self) -> None:
        """Releases connections."""


class RedisStatsStore(StatsStore):
    """Two hashes under the registry's hash tag (docs/redis-schema.md, "Scheduling figures")."""

    def __init__(self, url: str, *, key_prefix: str = "kvm", alpha: float = 0.3, refresh_ms: int = 1000,
                 username: str | None = None, password: str | None = None, max_per_node: int = 256) -> None:
        self._redis = connect(url, username=username, password=password)
        reg = f"{key_prefix}:{{{key_prefix}-reg}}"  # kvmesh.redis_keys.Keys' registry tag
        self.link_key = f"{reg}:stats:link-bw"
        self.engine_key = f"{reg}:stats:prefill-tps"
        self._alpha = alpha
        self._max_per_node = max_per_node
        self._refresh_s = refresh_ms / 1000.0
        self._cached: Figures | None = None
        self._cached_at = 0.0
        self._sha = ""

    async def _fold(self, key: str, triples: list) -> None:
        """``triples``: field, sample, owner (the node the figure counts against), ..."""
        if not triples:
            return
        if not self._sha:
            self._sha = await self._redis.script_load(_EWMA_LUA)
        args = (2, key, f"{key}:owners", self._alpha, MAX_FIGURES, self._max_per_node, MAX_STEP, *triples)
        try:
            await self._redis.evalsha(self._sha, *args)
        except redis.exceptions.NoScriptError:  # the server restarted or was flushed
            self._sha = await self._redis.script_load(_EWMA_LUA)
            await self._redis.evalsha(self._sha, *args)

    async def report(self, report: StatsReport, reporter: str = "") -> None:
        links: list = []
        for s in report.links:
            links += [f"{s.source_node_id}{_LINK_SEP}{s.dest_node_id}", repr(float(s.bytes_per_s)), s.dest_node_id]
        engines: list = []
        for e in report.engines:  # engine ids are "<node id>" or "<node id>:<name>" (control_plane.core.owns_engine)
            engines += [e.engine_id, repr(float(e.prefill_tokens_per_s)), reporter or e.engine_id.split(":", 1)[0]]
        await self._fold(self.link_key, links)
        await self._fold(self.engine_key, engines)
        self._cached = None  # this replica sees its own report at once

    async def figures(self) -> Figures:
        now = time.monotonic()
        if self._cached is not None and now - self._cached_at < self._refresh_s:
            return self._cached
        pipe = self._redis.pipeline(transaction=False)  # one slot: the keys share a hash tag
        pipe.hgetall(self.link_key)
        pipe.hgetall(self.engine_key)
        links, engines = await pipe.execute()
        link_bw = {}
        for name, value in links.items():
            source, _, dest = name.decode().partition(_LINK_SEP)
            link_bw[(source, dest)] = float(value)
        self._cached = Figures(link_bw, {k.decode(): float(v) for k, v in engines.items()})
        self._cached_at = now
        return self._cached

    async def close(self) -> None:
        await self._redis.aclose()
