"""A rate limit on the audit entries of denied and unauthenticated calls, that never drops one silently.

The audit stream keeps a bounded number of entries (tenancy.store.AUDIT_MAX): without a limit, anyone who can
reach the port could erase every admin action from it with denied calls (measured: 200 unauthenticated Pings
wrote 200 entries in 0.6 s, so about 5 minutes of that would have rolled the whole stream over). Denials go
through :class:`DenialAudit`: up to ``burst`` entries, then ``per_s`` a second (a token bucket shared by every
denial); each denial beyond that is counted under its (actor, action), and once per ``window_s`` one summary
entry per such pair says how many were suppressed, between which times (action ``suppressed:<action>``,
outcome ``SUPPRESSED``). Admin actions are written as they are, never through this.

Cost of a flood: at most ``per_s`` entries a second plus one summary per (actor, action) pair and window; the
pairs are bounded (``max_pairs``; beyond it, denials are counted under actor ``*``).

Threading model: one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from tenancy.model import AuditEntry

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Suppressed:
    count: int
    first_ms: int
    last_ms: int
    target: str
    outcome: str


class DenialAudit:
    """An audit sink for denials (call it as one) in front of the real one."""

    def __init__(self, sink, burst: int = 20, per_s: float = 1.0, window_s: float = 10.0,
                 max_pairs: int = 1024) -> None:
        self._sink = sink
        self._burst = burst
        self._per_s = per_s
        self._window_s = window_s
        self._max_pairs = max_pairs
        self._tokens = float(burst)
        self._refilled = time.monotonic()
        self._suppressed: dict[tuple[str, str], _Suppressed] = {}
        self._flush: asyncio.Task | None = None
        self.suppressed_total = 0

    async def __call__(self, entry: AuditEntry) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._refilled) * self._per_s)
        self._refilled = now
        if self._tokens >= 1:
            self._tokens -= 1
            await self._sink(entry)
            return
        self.suppressed_total += 1
        pair = (entry.actor, entry.action)
        if pair not in self._suppressed and len(self._suppressed) >= self._max_pairs:
            pair = ("*", entry.action)
        found = self._suppressed.get(pair)
        if found is None:
            self._suppressed[pair] = _Suppressed(1, entry.unix_ms, entry.unix_ms, entry.target, entry.outcome)
        else:
            found.count += 1
            found.last_ms = entry.unix_ms
        if self._flush is None:
            self._flush = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        try:
            await asyncio.sleep(self._window_s)
        finally:
            self._flush = None
            await self.flush()

    async def flush(self) -> None:
        """Writes one summary entry per (actor, action) with suppressed denials, now. Once a write fails (the
        store is down or frozen) the rest are logged, not tried one by one: each try waits out the store's
        timeout, and a server stopping after a flood of denials (1,024 pairs) waited ~34 minutes."""
        pending, self._suppressed = self._suppressed, {}
        items = iter(pending.items())
        for (actor, action), s in items:
            try:
                await self._sink(AuditEntry(
                    s.last_ms, actor, f"suppressed:{action.removeprefix('denied:')}", s.target, "SUPPRESSED",
                    f"{s.count} more {action} entries ({s.outcome}) between unix ms {s.first_ms} and {s.last_ms} "
                    f"were not written one by one (audit rate limit: {self._per_s:g}/s after a burst of "
                    f"{self._burst})"))
            except Exception:  # noqa: BLE001 - the store is down: the counts are logged instead of lost
                log.warning("could not audit %d suppressed %s entries of %s", s.count, action, actor, exc_info=True)
                for (actor, action), s in items:
                    log.warning("not audited (the store failed): %d suppressed %s entries of %s", s.count, action,
                                actor)
                return

    async def close(self) -> None:
        """Writes what is still counted (the server is stopping)."""
        if self._flush is not None:
            self._flush.cancel()
            await asyncio.gather(self._flush, return_exceptions=True)
        await self.flush()
