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

Neither proof depends on the node's cooperation alone, but both need it not to lie forever: a source that
answers every ask "not settled" would hold its slots for good. So a record not proven within ``force_after_s``
is reclaimed by force: the ``force`` callable makes every write still in flight into this node impossible (the
data plane replaces its NIXL agent, so the endpoints and registration old WRITEs name are gone:
:meth:`data_plane.transfer.Transport.rotate`), and then every quarantined slot, of every record, is free again.
The records of sends whose source never proved anything stay as *debts*: that source is not pulled from
(:meth:`Reclaimer.owes`) until it answers SETTLED or GONE for each, asked again as records are. A READ's record
(the consumer's own request, on the agent destroyed) owes nothing.

Per source, :meth:`Reclaimer.quarantined_from` is what its failed transfers hold now: the data plane pulls from
a source only while that stays under its budget.

Threading model: event-loop thread only. One task runs while anything is quarantined or owed and none
otherwise (an idle node costs nothing); each record is asked again after a delay that doubles up to a cap,
and one ask is bounded by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
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
    force_at: float = 0.0  # when its slots are reclaimed by force if nothing was proven by then
    asked: int = 0


# (record, timeout in s) -> what the source's address answers now; never raises
Ask = Callable[[Quarantine, float], Awaitable[Verdict]]
# () -> True once no write still in flight can land in this node's memory (False: not possible now, try later)
Force = Callable[[], Awaitable[bool]]


class Reclaimer:
    def __init__(self, ask: Ask, free: Callable[[list[int]], None], retry_s: float, max_retry_s: float,
                 timeout_s: float, force: Force | None = None, force_after_s: float = 0.0) -> None:
        """``free(slots)`` hands proven slots back to the tier; ``force`` (with ``force_after_s`` > 0) is the
        path that does not depend on the source (None: slots wait for a proof, however long)."""
        self._ask = ask
        self._free = free
        self._retry_s = retry_s
        self._max_retry_s = max(retry_s, max_retry_s)
        self._timeout_s = timeout_s
        self._force = force if force_after_s > 0 else None
        self._force_after_s = force_after_s
        self._records: list[Quarantine] = []
        self._debts: list[Quarantine] = []  # reclaimed by force; the source has proven nothing yet
        self._task: asyncio.Task | None = None
        self.forced = 0  # times slots were reclaimed by force

    def add(self, record: Quarantine) -> None:
        record.delay_s = self._retry_s
        record.next_at = time.monotonic() + record.delay_s
        record.force_at = time.monotonic() + self._force_after_s
        self._records.append(record)
        self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def active(self) -> bool:
        """Whether the task runs (only while something is quarantined or owed)."""
        return self._task is not None and not self._task.done()

    @property
    def records(self) -> int:
        """Failed transfers whose slots are still quarantined."""
        return len(self._records)

    def quarantined_from(self, source_node_id: str) -> int:
        """Slots quarantined now after transfers from that source."""
        return sum(len(r.slots) for r in self._records if r.source_node_id == source_node_id)

    def owes(self, source_node_id: str) -> bool:
        """Whether slots were reclaimed by force after a transfer from that source that it never proved over."""
        return any(r.source_node_id == source_node_id for r in self._debts)

    def debtors(self) -> Counter[str]:
        """Sources that owe proofs, and how many."""
        return Counter(r.source_node_id for r in self._debts)

    def _next_wake(self) -> float:
        wake = min(r.next_at for r in (*self._records, *self._debts))
        if self._force is not None and self._records:
            wake = min(wake, min(r.force_at for r in self._records))
        return wake

    async def _run(self) -> None:
        while self._records or self._debts:
            await asyncio.sleep(max(0.0, self._next_wake() - time.monotonic()))
            now = time.monotonic()
            if self._force is not None and any(r.force_at <= now for r in self._records):
                await self._reclaim_by_force()
            now = time.monotonic()
            due = [r for r in (*self._records, *self._debts) if r.next_at <= now]
            verdicts = await asyncio.gather(*(self._ask_bounded(r) for r in due))
            for record, verdict in zip(due, verdicts):
                record.asked += 1
                if verdict is Verdict.PENDING:
                    record.delay_s = min(record.delay_s * 2, self._max_retry_s)
                    record.next_at = time.monotonic() + record.delay_s
                    continue
                if record in self._debts:
                    self._debts.remove(record)
                    log.info("%s proved its transfer (lease %s) over: %s after %d asks; it may be pulled from "
                             "again%s", record.source_node_id, record.lease_id or "(a READ)", verdict.value,
                             record.asked, "" if not self.owes(record.source_node_id) else " once it proves the rest")
                    continue
                if record not in self._records:  # reclaimed by force while it was asked
                    continue
                self._records.remove(record)
                log.info("%d slots quarantined after a transfer from %s (%s) reclaimed: %s after %d asks",
                         len(record.slots), record.source_node_id, record.source_address, verdict.value,
                         record.asked)
                self._free(record.slots)

    async def _reclaim_by_force(self) -> None:
        """Makes every write still in flight impossible, then frees every quarantined slot; the records of sends
        whose source proved nothing become debts."""
        overdue = sorted({r.source_node_id for r in self._records if r.force_at <= time.monotonic()})
        try:
            done = await self._force()
        except Exception as exc:  # noqa: BLE001 - tried again at the next wake-up
            log.error("reclaiming quarantined slots by force failed: %r", exc)
            done = False
        if not done:
            for record in self._records:
                record.force_at = max(record.force_at, time.monotonic() + self._retry_s)
            return
        records, self._records = self._records, []
        self.forced += 1
        slots = [slot for r in records for slot in r.slots]
        for record in records:
            record.delay_s = self._retry_s
            record.next_at = time.monotonic() + record.delay_s
        # A READ's record is the consumer's own request, on the agent just destroyed: nothing is owed for it.
        self._debts.extend(r for r in records if r.lease_id)
        log.warning("%d quarantined slots reclaimed by force after %.0fs without a proof from %s: no write still in "
                    "flight can land in this node (its NIXL agent was replaced); those sources are not pulled from "
                    "until they prove their transfers over", len(slots), self._force_after_s, ", ".join(overdue))
        self._free(slots)

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
