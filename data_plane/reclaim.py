"""Reclaiming quarantined slots: a slot goes back to the free list only once no write can land in it.

A pull whose transfer failed in a way where bytes may still arrive (the source's WRITE timed out, the
source froze, NIXL could not cancel a request) quarantines its landing slots (:meth:`MemoryTier.quarantine`).
Each such failure is recorded here as a :class:`Quarantine`: the slots, the source (node, address, the NIXL
agent it answered the handshake with: its incarnation) and the lease the send named. A slot is reclaimed on
proof that nothing can still write into it (the ``ask`` callable asks the source; docs/data_plane.md,
"Reclaiming quarantined slots"):

* :attr:`Verdict.SETTLED`: the same incarnation answers that no WRITE under that lease is outstanding. Its
  answer also ends the lease, so a send naming it that arrives later (still queued behind a freeze) writes
  nothing. Only the lease's holder gets that answer about its lease (the peer key its grant binds).
* :attr:`Verdict.GONE`: another incarnation answers at the source's address. Data-plane servers bind their
  port exclusively (no SO_REUSEPORT, kvmesh.grpc_server): a frozen process keeps its listening socket, so
  a new one can bind the address only once the old one exited, and an exited process moves no more bytes.
* Anything else (no answer, refused, a write still outstanding, one NIXL could not cancel) keeps the slots
  quarantined; a READ's slots (the consumer's own request) are settled only by GONE.

Threading model: event-loop thread only. One task runs while anything is quarantined and none otherwise
(an idle node costs nothing); each record is asked again after a delay that doubles up to a cap, and one
ask is bounded by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from kvmesh.namespace import Namespace

log = logging.getLogger(__name__)


class Verdict(enum.Enum):
    SETTLED = "settled"  # the source's incarnation that took the lease has no write outstanding under it
    GONE = "gone"  # another incarnation answers at the source's address: the one that wrote has exited
    PENDING = "pending"  # not proven (still writing, stuck, frozen, unreachable, refused)


@dataclass(slots=True)
class Quarantine:
    """The landing slots of one failed transfer and who may still write into them."""

    slots: list[int]
    ns: Namespace
    source_node_id: str
    source_address: str
    source_agent: str  # the source's NIXL agent name at the handshake: its incarnation
    lease_id: str  # the lease the send named; "" for a READ (only GONE settles it)
    grant: bytes  # the pull's grant (a peer call needs one; renewed when refused)
    delay_s: float = 0.0
    next_at: float = 0.0
    asked: int = 0


# (record, timeout in s) -> what the source's address answers now; never raises
Ask = Callable[[Quarantine, float], Awaitable[Verdict]]


class Reclaimer:
    def __init__(self, ask: Ask, free: Callable[[list[int]], None], retry_s: float, max_retry_s: float,
                 timeout_s: float) -> None:
        """``free(slots)`` hands proven slots back to the tier."""
        self._ask = ask
        self._free = free
        self._retry_s = retry_s
        self._max_retry_s = max(retry_s, max_retry_s)
        self._timeout_s = timeout_s
        self._records: list[Quarantine] = []
        self._task: asyncio.Task | None = None

    def add(self, record: Quarantine) -> None:
        record.delay_s = self._retry_s
        record.next_at = time.monotonic() + record.delay_s
        self._records.append(record)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def active(self) -> bool:
        """Whether the task runs (only while something is quarantined)."""
        return self._task is not None and not self._task.done()

    @property
    def records(self) -> int:
        """Failed transfers whose slots are still quarantined."""
        return len(self._records)

    async def _run(self) -> None:
        while self._records:
            await asyncio.sleep(max(0.0, min(r.next_at for r in self._records) - time.monotonic()))
            now = time.monotonic()
            due = [r for r in self._records if r.next_at <= now]
            verdicts = await asyncio.gather(*(self._ask_bounded(r) for r in due))
            for record, verdict in zip(due, verdicts):
                record.asked += 1
                if verdict is Verdict.PENDING:
                    record.delay_s = min(record.delay_s * 2, self._max_retry_s)
                    record.next_at = time.monotonic() + record.delay_s
                    continue
                self._records.remove(record)
                log.info("%d slots quarantined after a transfer from %s (%s) reclaimed: %s after %d asks",
                         len(record.slots), record.source_node_id, record.source_address, verdict.value,
                         record.asked)
                self._free(record.slots)

    async def _ask_bounded(self, record: Quarantine) -> Verdict:
        try:
            return await asyncio.wait_for(self._ask(record, self._timeout_s), self._timeout_s)
        except TimeoutError:
            return Verdict.PENDING
        except Exception as exc:  # noqa: BLE001 - an ask that broke proves nothing; the loop must go on
            log.error("asking %s about quarantined slots failed: %r", record.source_address, exc)
            return Verdict.PENDING

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
