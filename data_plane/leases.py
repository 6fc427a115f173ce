"""Leases: pins held by a reader (a peer's Lookup, the engine's Acquire) that expire.

A reader that disappears must not pin blocks forever, so every pin is taken
under a lease with a deadline; :meth:`LeaseTable.expire` (run periodically by
the data plane) returns the leases that ran out so their pins can be dropped.
Releasing twice, or after expiry, is a no-op. Lease ids are 128 random bits
(a peer names its own lease in a later call; nobody can guess another's), and a
lease is handed back only to its holder, in its scope (the namespace it pins).

Threading model: not thread-safe; event-loop thread only. Time comes from an
injected clock so tests can move it by hand.
"""

from __future__ import annotations

import collections
import secrets
import time
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    def monotonic(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()


@dataclass(slots=True)
class Lease(Generic[T]):
    lease_id: str
    holder: str
    items: list[T]
    expires_at: float
    scope: str = ""  # what the items belong to (the namespace fingerprint of a Lookup's pins)
    group: str = ""  # what its items are counted under (a peer's pins: its node and the tenant), see LeaseTable.held


class LeaseTable(Generic[T]):
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._leases: dict[str, Lease[T]] = {}
        self._held: collections.Counter[str] = collections.Counter()  # group -> items of its live leases

    def grant(self, holder: str, items: list[T], ttl_s: float, scope: str = "", group: str = "") -> str:
        lease_id = secrets.token_hex(16)
        self._leases[lease_id] = Lease(lease_id, holder, items, self._clock.monotonic() + ttl_s, scope, group)
        if group:
            self._held[group] += len(items)
        return lease_id

    def held(self, group: str) -> int:
        """Items the live leases granted under ``group`` hold, whoever holds them (those taken, released or expired
        no longer count)."""
        return self._held[group]

    def _ended(self, lease: Lease[T]) -> None:
        del self._leases[lease.lease_id]
        if lease.group:
            self._held[lease.group] -= len(lease.items)
            if self._held[lease.group] <= 0:
                del self._held[lease.group]

    def take(self, lease_id: str, holder: str, scope: str) -> Lease[T] | None:
        """Ends the lease and returns it, so its items stay pinned for the caller (who unpins them); None,
        with the lease left as it is, if unknown, ended, expired (swept or not) or another holder's or
        scope's."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.holder != holder or lease.scope != scope \
                or lease.expires_at <= self._clock.monotonic():  # expired: the sweep unpins it
            return None
        self._ended(lease)
        return lease

    def release(self, lease_id: str, holder: str | None = None) -> list[T]:
        """The lease's items (to unpin); empty if unknown, already released, expired or (``holder`` given)
        held by someone else."""
        lease = self._leases.get(lease_id)
        if lease is None or (holder is not None and lease.holder != holder):
            return []
        self._ended(lease)
        return lease.items

    def expire(self) -> list[Lease[T]]:
        now = self._clock.monotonic()
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            self._ended(lease)
        return expired

    def __len__(self) -> int:
        return len(self._leases)
