"""Reclaiming held landing slots: a slot of a source's landing arena goes back to its free list only once no
write can land in it.

A pull whose transfer failed in a way where bytes may still arrive (the source's WRITE timed out, the source
froze, NIXL could not cancel this node's READ) holds its landing slots: they belong to that source's landing
arena (:mod:`data_plane.landing`), never to the CPU tier, so a failing source shrinks only the memory this node
keeps for it. Each such failure is recorded here as a :class:`Quarantine`: the arena and its slots, the source
(node, address, the NIXL agent it answered the handshake with: its incarnation) and the lease the send named. The
slots go back on proof that nothing can still write into them (the ``ask`` callable asks the source;
docs/data_plane.md, "Reclaiming held landing slots"):

* :attr:`Verdict.SETTLED`: the same incarnation answers that no WRITE under that lease is outstanding. Its
  answer also ends the lease, so a send naming it that arrives later (still queued behind a freeze) writes
  nothing. Only the lease's holder gets that answer about its lease (the peer key its grant binds).
* :attr:`Verdict.GONE`: another incarnation answers at the source's address. Data-plane servers bind their
  port exclusively (no SO_REUSEPORT, kvmesh.grpc_server): a frozen process keeps its listening socket, so
  a new one can bind the address only once the old one exited, and an exited process moves no more bytes.
* Anything else (no answer, refused, a write still outstanding, one NIXL could not cancel) keeps the slots
  held; a READ's slots (this node's own request) are settled only by GONE.

A source that never proves anything keeps its slots held, which costs it alone: its arena has that many slots
fewer. Once they are half its arena or more, the node retires that arena for a fresh one (at most
``landing_renewals_per_source`` times per NIXL agent: an honest source whose WRITEs timed out on a cut path, which
only its restart proves over, is pulled from again), and its records go with it (:meth:`Reclaimer.drop_arena`);
then a pull from it MISSes once no slot is free. Nothing here depends on a source's cooperation to keep another
source's, or any tenant's, memory usable. A new NIXL agent (:meth:`Reclaimer.drop_all`, after the node replaced
its agent) takes every arena with the old one, and every record goes with them.

Threading model: event-loop thread only. One task runs while anything is held and none otherwise (an idle node
costs nothing); each record is asked again after a delay that doubles up to a cap, and one ask is bounded by
``timeout_s``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

import numpy as np

from kvmesh.namespace import Namespace

if TYPE_CHECKING:
    from data_plane.landing import LandingArena

log = logging.getLogger(__name__)


class Verdict(enum.Enum):
    SETTLED = "settled"  # the source's incarnation that took the lease has no write outstanding under it
    GONE = "gone"  # another incarnation answers at the source's address: the one that wrote has exited
    PENDING = "pending"  # not proven (still writing, stuck, frozen, unreachable, refused)


@dataclass(slots=True, eq=False)  # a record is itself (its slots are an array, which == compares elementwise)
class Quarantine:
    """The landing slots of one failed transfer and who may still write into them."""

    arena: "LandingArena"  # the source's landing arena the slots belong to
    slots: np.ndarray
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
    def __init__(self, ask: Ask, free: Callable[[Quarantine], None], retry_s: float, max_retry_s: float,
                 timeout_s: float) -> None:
        """``free(record)`` hands a proven record's slots back to its arena."""
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
        self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def active(self) -> bool:
        """Whether the task runs (only while something is held)."""
        return self._task is not None and not self._task.done()

    @property
    def records(self) -> int:
        """Failed transfers whose slots are still held."""
        return len(self._records)

    @property
    def held(self) -> int:
        """Landing slots held now, of every source."""
        return sum(len(r.slots) for r in self._records)

    def held_in(self, arena: "LandingArena") -> int:
        """Slots of that arena held now."""
        return sum(len(r.slots) for r in self._records if r.arena is arena)

    def drop_arena(self, arena: "LandingArena") -> int:
        """Forgets the records of that arena (it was retired: never used again): the slots dropped."""
        dropped = self.held_in(arena)
        self._records = [r for r in self._records if r.arena is not arena]
        return dropped

    def drop_all(self) -> int:
        """Forgets every record (their arenas went with the NIXL agent just replaced): the slots dropped."""
        dropped, self._records = self.held, []
        return dropped

    async def _run(self) -> None:
        while self._records:
            await asyncio.sleep(max(0.0, min(r.next_at for r in self._records) - time.monotonic()))
            now = time.monotonic()
            due = [r for r in self._records if r.next_at <= now]
            verdicts = await asyncio.gather(*(self._ask_bounded(r) for r in due))
            for record, verdict in zip(due, verdicts):
                record.asked += 1
                if record not in self._records:  # dropped with its arena while it was asked
                    continue
                if verdict is Verdict.PENDING:
                    record.delay_s = min(record.delay_s * 2, self._max_retry_s)
                    record.next_at = time.monotonic() + record.delay_s
                    continue
                self._records.remove(record)
                log.info("%d landing slots held after a transfer from %s (%s) reclaimed: %s after %d asks",
                         len(record.slots), record.source_node_id, record.source_address, verdict.value,
                         record.asked)
                self._free(record)

    async def _ask_bounded(self, record: Quarantine) -> Verdict:
        try:
            return await asyncio.wait_for(self._ask(record, self._timeout_s), self._timeout_s)
        except TimeoutError:
            return Verdict.PENDING
        except Exception as exc:  # noqa: BLE001 - an ask that broke proves nothing; the loop must go on
            log.error("asking %s about held landing slots failed: %r", record.source_address, exc)
            return Verdict.PENDING

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
