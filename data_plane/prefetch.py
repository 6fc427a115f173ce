"""Route-time prefetch, the destination node's half (docs/scheduling.md#prefetch-at-route-time).

``Route`` decided that this node's engine will pull a prefix from a source and signed an order for it
(control_plane.prefetch); the scheduler hands the order to this node's ``Prefetch``, whose ticket was checked
(``NodeAuth.check_prefetch``). :class:`Prefetcher` starts that pull at once, through the core's ordinary ``pull``:
under this node's own grant, the tenant's CPU-tier limit and policy (the core asks the control plane for both, as
for any pull), bounded by ``prefetch_timeout_ms``. The engine's own Pull, when its request arrives, joins the blocks
still arriving (the core's coalescing: one transfer, not two) or finds them committed.

Bounds:

* at most ``prefetch_cap_bytes`` of prefetches run at once on the node (more: OVER_CAP, nothing started); the
  same blocks twice: IN_FLIGHT, nothing new;
* one tenant's prefetches take at most an equal share of that cap among the tenants contending for it: those with
  prefetches running, or refused within the last 2 x ``prefetch_timeout_ms``. Alone, a tenant has the whole cap;
  once another asks, its running prefetches end within ``prefetch_timeout_ms`` and it starts no more past its share
  while the other asks again within the next ``prefetch_timeout_ms``, so no tenant (a scheduler whose sources
  stall) keeps the node's prefetches from another;
* a prefetch holds slots only while its pull runs (``prefetch_timeout_ms``); then its blocks are ordinary,
  unpinned, evictable cache, or were never reserved;
* its bytes that no local engine acquired within ``prefetch_use_window_ms`` after they landed are counted
  wasted (``kvmesh_dp_prefetch_bytes_total{kind="wasted"}``) and the record is dropped.

A prefetch that fails or is late changes nothing for the request: its own Pull (:meth:`Prefetcher.pull`) waits for
joined blocks no longer than its own deadline; blocks a failed prefetch did not bring are fetched by that Pull itself
with the time it has left (as if there had been no prefetch), and what is still missing at its deadline is a MISS
(recomputed), as without prefetch.

Each prefetch is one span, ``kvmesh.prefetch``, under the Prefetch call (which continues the scheduler's Route
trace); the engine's later Acquire of its blocks links to it.

Lifecycle of one prefetch (only moves forward): RUNNING -> LANDED (pull ended) -> settled (record dropped: every
landed block acquired, or the use window passed). Threading model: event-loop thread only.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Awaitable, Callable

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvmesh import tracing
from kvmesh.namespace import Namespace
from tenancy.grants import PrefetchTicket, prefetch_blocks_digest

from data_plane.types import LookupStatus, PullResult

log = logging.getLogger(__name__)

PullFn = Callable[..., Awaitable[PullResult]]  # DataPlaneCore.pull


class PrefetchStatus(enum.Enum):
    """The answer to a Prefetch; values equal the proto enum."""

    STARTED = 1
    IN_FLIGHT = 2
    DISABLED = 3
    OVER_CAP = 4


class PrefetchState(enum.Enum):
    RUNNING = 1
    LANDED = 2


@dataclass(slots=True)
class Prefetch:
    """All state of one prefetch."""

    ns: Namespace
    hashes: tuple[bytes, ...]
    reserved_bytes: int  # counted against the cap while RUNNING
    span: trace.Span
    state: PrefetchState = PrefetchState.RUNNING
    landed: frozenset[bytes] = frozenset()  # blocks this prefetch brought here
    moved_bytes: int = 0
    acquired: set[bytes] = field(default_factory=set)  # of its blocks, those a local engine acquired
    used_bytes: int = 0
    landed_at: float = 0.0


class PrefetchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.prefetches = Counter("kvmesh_dp_prefetches", "route-time prefetches, by outcome", ["outcome"],
                                  registry=registry)
        self.bytes = Counter("kvmesh_dp_prefetch_bytes", "bytes of route-time prefetches", ["kind"],
                             registry=registry)
        self.inflight = Gauge("kvmesh_dp_prefetch_inflight_bytes", "bytes of route-time prefetches running now "
                              "(at most prefetch_max_inflight_bytes)", registry=registry)


class Prefetcher:
    def __init__(self, pull: PullFn, block_bytes: int, registry: CollectorRegistry, *, enabled: bool,
                 timeout_ms: int, cap_bytes: int, use_window_s: float, pull_timeout_ms: int,
                 max_pull_timeout_ms: int, clock: Callable[[], float] = time.monotonic) -> None:
        """``pull``: the core's; ``pull_timeout_ms`` / ``max_pull_timeout_ms``: the bound of a Pull that names
        none, and the longest one may name (the core's)."""
        self._pull = pull
        self._pull_bounds = (pull_timeout_ms, max_pull_timeout_ms)
        self._block_bytes = block_bytes
        self._enabled = enabled
        self._timeout_ms = timeout_ms
        self._cap_bytes = cap_bytes
        self._use_window_s = use_window_s
        self._clock = clock
        self.metrics = PrefetchMetrics(registry)
        self._records: dict[tuple[str, str], Prefetch] = {}  # (namespace fingerprint, blocks digest) -> record
        self._by_block: dict[tuple[str, bytes], Prefetch] = {}  # (namespace fingerprint, block hash) -> its record
        self._inflight_bytes = 0
        self._tenant_bytes: dict[str, int] = {}  # tenant -> bytes of its prefetches running (none: absent)
        self._refused_at: dict[str, float] = {}  # tenant -> when a prefetch of its was last refused OVER_CAP
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    @property
    def pending(self) -> int:
        """Prefetches not settled yet (running, or landed and within the use window)."""
        return len(self._records)

    def start(self, ns: Namespace, hashes: list[bytes], ticket: PrefetchTicket) -> PrefetchStatus:
        """Starts the ticket's pull in the background (the ticket was checked for this node, ``ns`` and
        ``hashes``)."""
        status = self._admit(ns, hashes)
        self.metrics.prefetches.labels(status.name.lower()).inc()
        if status is not PrefetchStatus.STARTED:
            return status
        reserved = len(hashes) * self._block_bytes
        span = tracing.tracer("kvmesh.data_plane").start_span("kvmesh.prefetch", attributes={
            tracing.ATTR.TENANT: ns.tenant, tracing.ATTR.NAMESPACE: ns.fingerprint, tracing.ATTR.BLOCKS: len(hashes),
            tracing.ATTR.SOURCE_NODE: ticket.prefetch_source_node_id})
        record = Prefetch(ns, tuple(hashes), reserved, span)
        self._records[(ns.fingerprint, prefetch_blocks_digest(hashes))] = record
        self._by_block.update({(ns.fingerprint, h): record for h in hashes})
        self._inflight_bytes += reserved
        self._tenant_bytes[ns.tenant] = self._tenant_bytes.get(ns.tenant, 0) + reserved
        self.metrics.inflight.set(self._inflight_bytes)
        task = asyncio.get_running_loop().create_task(self._run(record, ticket))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())
        return status

    def _admit(self, ns: Namespace, hashes: list[bytes]) -> PrefetchStatus:
        if not self._enabled:
            return PrefetchStatus.DISABLED
        if (ns.fingerprint, prefetch_blocks_digest(hashes)) in self._records:
            return PrefetchStatus.IN_FLIGHT
        need = len(hashes) * self._block_bytes
        now = self._clock()
        self._refused_at = {t: at for t, at in self._refused_at.items() if now - at < 2 * self._timeout_ms / 1000}
        contending = self._tenant_bytes.keys() | self._refused_at.keys() | {ns.tenant}
        share = self._cap_bytes // len(contending)
        if self._inflight_bytes + need > self._cap_bytes or self._tenant_bytes.get(ns.tenant, 0) + need > share:
            self._refused_at[ns.tenant] = now
            return PrefetchStatus.OVER_CAP
        return PrefetchStatus.STARTED

    async def _run(self, record: Prefetch, ticket: PrefetchTicket) -> None:
        result: PullResult | None = None
        with trace.use_span(record.span, end_on_exit=True):
            try:
                result = await self._pull(record.ns, list(record.hashes), ticket.prefetch_source_node_id,
                                          ticket.prefetch_source_address, timeout_ms=self._timeout_ms,
                                          route_token=ticket.prefetch_route_token.encode())
            except Exception as exc:  # noqa: BLE001 - a failed prefetch is the request's own pull, later
                log.warning("prefetch from %s failed: %s", ticket.prefetch_source_node_id, exc)
            moved = result.bytes_pulled if result is not None else 0
            pulled = result.pulled if result is not None else 0  # joined ones too: used bytes are capped by moved
            start = result.already_local if result is not None else 0
            record.span.set_attributes({tracing.ATTR.BYTES: moved,
                                        tracing.ATTR.OUTCOME: "pulled" if moved else "miss"})
        self._inflight_bytes -= record.reserved_bytes
        left = self._tenant_bytes.pop(record.ns.tenant) - record.reserved_bytes
        if left:
            self._tenant_bytes[record.ns.tenant] = left
        self.metrics.inflight.set(self._inflight_bytes)
        here = result is not None and bool(result.statuses) and result.statuses[0] is LookupStatus.HIT
        self.metrics.prefetches.labels("landed" if moved else "joined" if here else "failed").inc()
        self.metrics.bytes.labels("prefetched").inc(moved)
        record.state, record.moved_bytes, record.landed_at = PrefetchState.LANDED, moved, self._clock()
        record.landed = frozenset(record.hashes[start:start + pulled])
        self._count_used(record, set())
        self.sweep()

    async def pull(self, ns: Namespace, hashes: list[bytes], source_node_id: str, source_address: str, *,
                   timeout_ms: int = 0, **options) -> PullResult:
        """A local engine's Pull (the core's, same arguments). The core joins blocks a prefetch is bringing; when
        that prefetch fails, the blocks it did not bring come back MISS although this Pull may have time left: then
        they are pulled once more, by this Pull, within what is left of its own bound."""
        started = time.monotonic()
        keys = list(zip(repeat(ns.fingerprint), hashes))
        joining = not self._by_block.keys().isdisjoint(keys) and any(
            (r := self._by_block.get(key)) is not None and r.state is PrefetchState.RUNNING for key in keys)
        first = await self._pull(ns, hashes, source_node_id, source_address, timeout_ms=timeout_ms, **options)
        default_ms, max_ms = self._pull_bounds
        left_ms = int(min(timeout_ms or default_ms, max_ms) - (time.monotonic() - started) * 1000)
        if not joining or first.refused or all(st is LookupStatus.HIT for st in first.statuses) or left_ms <= 0:
            return self._as_joined(ns, hashes, first)
        again = await self._pull(ns, hashes, source_node_id, source_address, timeout_ms=left_ms, **options)
        return self._as_joined(ns, hashes, PullResult(
            again.statuses, first.pulled + again.pulled, first.already_local, first.bytes_pulled + again.bytes_pulled,
            first.lookup_ms + again.lookup_ms, first.transfer_ms + again.transfer_ms, first.joined + again.joined,
            again.refused, checked=first.checked + again.checked))

    def _as_joined(self, ns: Namespace, hashes: list[bytes], result: PullResult) -> PullResult:
        """``result`` with the leading local blocks that a prefetch brought (it landed before this Pull came)
        counted as pulled by this Pull and joined (moved by another pull), as blocks it joined in flight are: to
        the engine, a prefix its route-time prefetch brought from the peer is a pull, not a local hit."""
        start = result.already_local
        while start > 0 and (r := self._by_block.get((ns.fingerprint, hashes[start - 1]))) is not None \
                and hashes[start - 1] in r.landed:
            start -= 1
        moved_here = result.already_local - start
        if not moved_here:
            return result
        return replace(result, pulled=result.pulled + moved_here, already_local=start,
                       joined=result.joined + moved_here)

    def acquired(self, ns: Namespace, hashes: list[bytes]) -> None:
        """A local engine acquired ``hashes``: prefetched bytes among them are used; the current span (the
        engine's Acquire, or its Pull that pinned them) links to each prefetch that brought them."""
        if not self._by_block:
            return
        mine: dict[int, tuple[Prefetch, set[bytes]]] = {}
        for h in hashes:
            record = self._by_block.get((ns.fingerprint, h))
            if record is not None:
                mine.setdefault(id(record), (record, set()))[1].add(h)
        current = trace.get_current_span()
        for record, blocks in mine.values():
            current.add_link(record.span.get_span_context(), {"kvmesh.link": "prefetch"})
            self._count_used(record, blocks)
        if mine:
            self.sweep()

    def _count_used(self, record: Prefetch, hashes: set[bytes]) -> None:
        record.acquired |= hashes
        if record.state is not PrefetchState.LANDED:
            return
        used = min(len(record.landed & record.acquired) * self._block_bytes, record.moved_bytes)
        if used > record.used_bytes:
            self.metrics.bytes.labels("used").inc(used - record.used_bytes)
            record.used_bytes = used

    def sweep(self) -> int:
        """Settles landed prefetches that were used in full or whose use window passed (their unused bytes
        counted wasted); the number settled."""
        now = self._clock()
        done = [key for key, r in self._records.items() if r.state is PrefetchState.LANDED and (
            r.used_bytes >= r.moved_bytes or now - r.landed_at >= self._use_window_s)]
        for key in done:
            record = self._records.pop(key)
            for h in record.hashes:
                if self._by_block.get((key[0], h)) is record:
                    del self._by_block[(key[0], h)]
            wasted = record.moved_bytes - record.used_bytes
            if wasted:
                self.metrics.bytes.labels("wasted").inc(wasted)
        return len(done)

    async def _sweep_loop(self) -> None:
        period = min(1.0, max(0.05, self._use_window_s / 10))
        while True:
            await asyncio.sleep(period)
            self.sweep()

    async def close(self) -> None:
        for task in [*self._tasks, *([self._sweeper] if self._sweeper else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, *([self._sweeper] if self._sweeper else []), return_exceptions=True)
