"""Publishes one node's tier changes to the control plane, in order, surviving outages.

Used by every data plane (and usable by any node-side process). ``stored`` and
``removed`` only enqueue, so the node never waits on the control plane; a
background task sends numbered batches over ``StreamEvents`` and keeps each
batch until it is acked.

Failure policy
- Control plane unreachable: retry every ``retry_s``; unacked batches are resent. Logged once when it
  starts, then at most every ``OUTAGE_LOG_EVERY_S`` while it lasts, and once when it answers again
  with their original seq (the server treats replays as duplicates).
- Key refused (UNAUTHENTICATED, PERMISSION_DENIED): retried like an outage, unless
  ``stop_on_refusal``: then the publisher stops and ``refusal`` holds the error.
- Sequence gap (RESYNC_REQUIRED), stale incarnation, expired lease, unknown
  node: register a new incarnation (which fences everything the old one
  published) and stream the node's full ``snapshot()``; queued events older
  than the snapshot are dropped because the snapshot already reflects them.

Threading model: ``stored``/``removed`` may be called from any thread; all
network work runs on the event loop that called ``start``.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import grpc

from kvmesh.channels import ClientTLS, channel
from kvmesh.namespace import Namespace
from kvmesh.v1 import control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc

from control_plane import wire
from control_plane.model import MAX_CLEARS_PER_BATCH, Cleared, Medium, NodeInfo, Removed, Stored

log = logging.getLogger(__name__)

OUTAGE_LOG_EVERY_S = 30.0

__all__ = ["EventPublisher", "NodeInfo"]

Snapshot = Callable[[], Iterable[tuple[Namespace, int, list[bytes]]]]
_RESYNC_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
_REFUSAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class _Kind(enum.Enum):
    STORED = 1
    REMOVED = 2
    CLEARED = 3


@dataclass(frozen=True, slots=True)
class _Change:
    ns: Namespace
    kind: _Kind
    medium: int
    block_hashes: tuple[bytes, ...] = ()


class _Resync(Exception):
    """The control plane no longer trusts this incarnation's stream."""


def _why(exc: grpc.aio.AioRpcError) -> str:
    """The status code; with the control plane's words when it answered (a refusal says what to change)."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return code.name
    return f"{code.name}: {exc.details()}"


class _OutageLog:
    """A control-plane outage in a few log lines, not one per retry: when it starts, every
    :data:`OUTAGE_LOG_EVERY_S` while it lasts (how long, how many tries) and when it ends."""

    def __init__(self, retry_s: float) -> None:
        self._retry_s = retry_s
        self._since: float | None = None
        self._logged = 0.0
        self._tries = 0

    def failed(self, why: str) -> None:
        now = time.monotonic()
        self._tries += 1
        if self._since is None:
            self._since = self._logged = now
            log.warning("control plane unreachable or refusing (%s); retrying every %.1fs", why, self._retry_s)
        elif now - self._logged >= OUTAGE_LOG_EVERY_S:
            self._logged = now
            log.warning("control plane still unreachable or refusing (%s) after %.0fs and %d tries; retrying "
                        "every %.1fs",
                        why, now - self._since, self._tries, self._retry_s)

    def answered(self) -> None:
        if self._since is not None:
            log.warning("control plane reachable again after %.1fs and %d tries", time.monotonic() - self._since,
                        self._tries)
            self._since, self._tries = None, 0


class EventPublisher:
    def __init__(self, control_plane_address: str, node: NodeInfo, snapshot: Snapshot, *,
                 max_batch_blocks: int = 4096, retry_s: float = 0.5,
                 metadata: tuple[tuple[str, str], ...] = (), tls: ClientTLS | None = None,
                 stop_on_refusal: bool = False) -> None:
        self._address = control_plane_address
        self._stop_on_refusal = stop_on_refusal
        self.refusal: grpc.aio.AioRpcError | None = None  # why it stopped (``stop_on_refusal``)
        self._tls = tls
        self._node = node.validate()
        self._snapshot = snapshot
        self._max_batch_blocks = max_batch_blocks
        self._retry_s = retry_s
        self._metadata = metadata
        self._lock = threading.Lock()
        self._queue: collections.deque[_Change] = collections.deque()
        self._unacked: collections.deque[pb.EventBatch] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ControlPlaneStub | None = None
        self.incarnation = 0
        self._seq = 0
        self._lease_ms = 10_000
        self._need_register = True
        self._outage = _OutageLog(retry_s)

    # -- producer side (any thread) ---------------------------------------------

    def stored(self, ns: Namespace, block_hashes: list[bytes], medium: int) -> None:
        if block_hashes:
            self._put(_Change(ns, _Kind.STORED, medium, tuple(block_hashes)))

    def removed(self, ns: Namespace, block_hashes: list[bytes], medium: int) -> None:
        """``medium`` 0 (MEDIUM_UNSPECIFIED): every tier."""
        if block_hashes:
            self._put(_Change(ns, _Kind.REMOVED, medium, tuple(block_hashes)))

    def cleared(self, ns: Namespace, medium: int = 0) -> None:
        """The node dropped every block of ``medium`` (0: of every tier and namespace)."""
        self._put(_Change(ns, _Kind.CLEARED, medium))

    def _put(self, change: _Change) -> None:
        with self._lock:
            self._queue.append(change)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        self._channel = channel(self._address, None, self._tls)
        self._stub = pb_grpc.ControlPlaneStub(self._channel)
        self._tasks = [asyncio.create_task(self._run(), name="kvmesh-publisher"),
                       asyncio.create_task(self._heartbeats(), name="kvmesh-heartbeat")]

    async def flush(self, timeout: float) -> bool:
        """Waits until every change enqueued so far is acked; False on timeout (or once stopped by a refusal)."""
        assert self._idle is not None and self._wake is not None, "start() first"
        deadline = asyncio.get_running_loop().time() + timeout
        while self._queue or self._unacked or self._need_register:
            if self.refusal is not None:
                return False
            self._idle.clear()
            self._wake.set()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._idle.wait(), min(remaining, 0.1))
            except asyncio.TimeoutError:
                pass
        return True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        if self._channel is not None:
            await self._channel.close()

    # -- background -------------------------------------------------------------------

    async def _register(self) -> None:
        node = wire.node_info_to_pb(self._node)
        reply = await self._stub.RegisterNode(pb.RegisterNodeRequest(node=node), metadata=self._metadata)
        self._outage.answered()
        self.incarnation, self._lease_ms, self._seq = reply.incarnation, reply.lease_ms, reply.next_seq - 1
        # The snapshot is the truth now: it supersedes unacked batches. Queued
        # changes are kept and replayed after it: each is the latest for its block.
        with self._lock:
            self._unacked.clear()
            snapshot = [_Change(ns, _Kind.STORED, medium, tuple(hs)) for ns, medium, hs in self._snapshot() if hs]
            self._queue.extendleft(reversed(snapshot))
        self._need_register = False
        log.info("node %s registered as incarnation %d; resyncing %d snapshot runs",
                 self._node.node_id, self.incarnation, len(snapshot))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            if self._need_register:
                continue
            try:
                await self._stub.Heartbeat(
                    pb.HeartbeatRequest(node_id=self._node.node_id, incarnation=self.incarnation),
                    timeout=self._lease_ms / 3000, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _RESYNC_CODES:
                    self._need_register = True
                    self._wake.set()
                else:
                    self._outage.failed(_why(exc))  # the same outage as the stream's, logged with it

    async def _run(self) -> None:
        while True:
            try:
                if self._need_register:
                    await self._register()
                await self._stream()
            except _Resync:
                self._need_register = True
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _RESYNC_CODES:
                    log.info("control plane asks for a resync: %s", exc.details())
                    self._need_register = True
                elif self._stop_on_refusal and exc.code() in _REFUSAL_CODES:
                    self.refusal = exc
                    return
                else:
                    self._outage.failed(_why(exc))
                    await asyncio.sleep(self._retry_s)

    def _next_batch(self) -> pb.EventBatch | None:
        """Coalesces queued changes of one namespace into one batch."""
        with self._lock:
            if not self._queue:
                return None
            ns = self._queue[0].ns
            events, blocks, clears = [], 0, 0
            while self._queue and self._queue[0].ns == ns and blocks < self._max_batch_blocks:
                if self._queue[0].kind is _Kind.CLEARED:
                    if clears == MAX_CLEARS_PER_BATCH:
                        break
                    clears += 1
                change = self._queue.popleft()
                blocks += len(change.block_hashes)
                medium = Medium(change.medium) if change.medium else None
                if change.kind is _Kind.STORED:
                    events.append(Stored(change.block_hashes, medium, ns.cache_config.block_size))
                elif change.kind is _Kind.REMOVED:
                    events.append(Removed(change.block_hashes, medium))
                else:
                    events.append(Cleared(medium))
        self._seq += 1
        return pb.EventBatch(node_id=self._node.node_id, incarnation=self.incarnation, seq=self._seq,
                             namespace=ns.to_proto(), events=[wire.event_to_pb(e) for e in events])

    async def _stream(self) -> None:
        outbox: asyncio.Queue[pb.EventBatch] = asyncio.Queue()
        for batch in self._unacked:  # resend what the last stream did not confirm
            outbox.put_nowait(batch)

        async def requests():
            while True:
                yield await outbox.get()

        call = self._stub.StreamEvents(requests(), metadata=self._metadata)

        async def feed():
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._need_register:
                    call.cancel()
                    return
                while (batch := self._next_batch()) is not None:
                    self._unacked.append(batch)
                    outbox.put_nowait(batch)
                if not self._unacked:
                    self._idle.set()

        feeder = asyncio.create_task(feed())
        self._wake.set()
        try:
            async for ack in call:
                self._outage.answered()
                if ack.status == pb.ACK_STATUS_RESYNC_REQUIRED:
                    raise _Resync()
                while self._unacked and self._unacked[0].seq <= ack.seq:
                    self._unacked.popleft()
                if not self._unacked and not self._queue:
                    self._idle.set()
        except asyncio.CancelledError:
            # the call was cancelled by feed() for a resync: register again; this task cancelled (stop()): end
            if self._need_register and not asyncio.current_task().cancelling():
                return
            raise
        finally:
            feeder.cancel()
            call.cancel()
        if not self._need_register:  # the server ended the stream: reconnect after a pause
            await asyncio.sleep(self._retry_s)
