"""Moving block bytes between nodes: the :class:`Transport` contract and NIXL.

Implementor contracts:
  * The local region is registered once, before :meth:`Transport.ready`
    returns (construction may hand that work to a thread), and stays
    registered until :meth:`Transport.close`. Whether peers get its metadata
    (and so may READ it one-sided) is the caller's choice: by default a source
    hands out none and WRITEs the blocks a grant covers (docs/security.md).
  * A source this node pulls from is handed :meth:`Transport.landing_metadata`:
    connection info and that source node's own landing arena only
    (data_plane.landing), never the region: a peer holding metadata can READ
    and WRITE whatever it describes. An arena stays registered, and is never
    given to another node, until the agent is replaced (:meth:`rotate`).
  * ``read`` copies ``length`` bytes from each remote address into each local
    address, which lies in a landing arena (never the region: a READ that
    may still land must not reach memory anything else uses). NixlTransport:
    one descriptor per run of blocks contiguous on both sides, the blocks
    split over its ``lanes`` transfer requests, posted at once. It returns
    only when all of them have arrived (every lane ended). Otherwise it
    raises :class:`TransferFailed`; its
    ``may_still_write`` is True when the request timed out (over TCP, bytes
    already in the socket land when the path drains, cancelled or not) or
    could not be cancelled, and then the caller must not reuse the
    destination arena slots until that is proven over (data_plane.reclaim); its
    ``released`` says whether NIXL released the request (False: this
    process may still move its bytes until it exits).
  * ``write`` is the mirror image: the local offsets are the source, the
    remote addresses lie in the peer's registered region; same guarantees.
    A write with a ``tag`` (a send's: its lease id) goes as pieces, one
    request each (NixlTransport: at most ``piece_bytes``, one lane's pieces
    in order, a few posted at once), each with a NIXL notification naming the tag and
    its blocks, which UCX sends once the piece's bytes are flushed to the
    peer; a consumer waiting in :meth:`Transport.landed` for that tag from
    that agent is told of each piece, checks it while the next one moves,
    and still waits for the write's end (a notification is a hint of when
    to look, never proof of what landed).
  * ``read`` never waits past its timeout; a peer that died or disconnected
    (NIXL_ERR_REMOTE_DISCONNECT) fails the read, it does not hang it.
  * A peer's metadata is read (:meth:`Transport.describe_peer`: its agent name, hence its node, and the
    memory it registered) before it is loaded, and refused whole if it is not exactly what an agent
    hands out: metadata NIXL cannot load must never reach it (data_plane.nixl_metadata).
  * :meth:`Transport.rotate` replaces the local agent (a new name, the region
    registered anew, every peer forgotten) and destroys the old one, so no
    WRITE naming the old agent can land any more (its endpoints, sockets and
    registration are gone): the path that reclaims quarantined slots without
    the source's help (data_plane.reclaim). It refuses (False) while a
    transfer is in flight or one NIXL could not release ever was.
  * Peers are added from their metadata and cached by agent name. A transfer
    that fails drops its peer's endpoint: the next use needs a new handshake
    (:meth:`Transport.add_peer` again), whose endpoint opens a new connection
    instead of reusing one that may be stalled (TCP retransmission backoff
    after a cut; a congestion window that a latency step collapsed).

Threading model: called from the event-loop thread. ``read`` posts and polls
the request in a worker thread so the loop keeps serving while bytes move (the
agent's own threads, which end with it: NIXL binds each thread to one of an
agent's UCX workers by the agent's address, and a thread that outlived an
agent of three workers would use worker 2 of the next agent built at that
address, one of a single worker: "Worker ID out of range");
NIXL's own progress thread drives UCX. That thread sleeps in ``poll()`` on the
UCX worker's event descriptor, waking when a message arrives (a peer's
connection set-up or an active message) or after ``progress_wait_ms``: an idle
node uses no CPU. (The nixl 1.5.1 Python wrapper hard-codes a 0 ms timeout,
which turns that loop into a busy poll of a whole core; :func:`new_nixl_agent`
sets the timeout.) While anyone waits for landed pieces, a task on the loop
reads the agent's notifications every ``_LANDED_POLL_S``.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import logging
import threading
import time
from typing import Callable, Iterator

import numpy as np

from kvmesh.errors import InvalidArgument, Unavailable

from data_plane.landing import LandingArena
from data_plane.metadata_vetting import MetadataVetter
from data_plane.nixl_metadata import AgentMetadata, agent_name, node_of_agent, read_agent_metadata
from data_plane.shm import SharedRegion

log = logging.getLogger(__name__)

# Polling a transfer: spin first (small reads finish in microseconds), then sleep between checks.
_SPINS_BEFORE_SLEEP = 200
_POLL_SLEEP_S = 0.0002
_PIECES_IN_FLIGHT = 4  # requests of one lane posted at once (a WRITE in pieces)


_AGENT_CONFIG_LOCK = threading.Lock()
_XFER_THREADS_PER_LANE = 4  # threads polling transfers, per lane (several pulls and sends at once, a hung one)
_PEER_SHARE_OF_THREADS = 2  # one peer node's transfers hold at most 1/2 of them: a frozen (or stalling) one leaves
# the rest to the others
_MAX_NOTES = 256  # senders whose latest notification is kept until taken
_NOTE_POLL_S = 0.002
_LANDED = b"kvmesh-landed:"  # prefix of a piece's notification: the tag, its first block index, its block count
_LANDED_POLL_S = 0.0005

# (first block index, block count) of a piece of a WRITE that has landed
OnLanded = Callable[[int, int], None]


def landed_message(tag: bytes, first: int, count: int) -> bytes:
    """The notification a piece of a WRITE tagged ``tag`` carries (:meth:`Transport.landed` reads it)."""
    return b"%s%s:%d:%d" % (_LANDED, tag, first, count)


def new_nixl_agent(name: str, progress_wait_ms: int, workers: int = 1):
    """A NIXL agent (UCX backend with ``workers`` UCX workers) whose progress thread waits up to
    ``progress_wait_ms`` per ``poll()``.

    ``nixl_agent`` builds its core config itself and sets the progress-thread delay to 0; the
    binding's config class is swapped, only while this agent is built, for one that keeps ours.
    """
    from nixl import _api

    real = _api.nixlBind.nixlAgentConfig
    delay_us = progress_wait_ms * 1000

    class _Config(real):
        def __setattr__(self, field: str, value) -> None:
            super().__setattr__(field, delay_us if field == "pthrDelay" else value)

    with _AGENT_CONFIG_LOCK:
        _api.nixlBind.nixlAgentConfig = _Config
        try:
            agent = _api.nixl_agent(name, _api.nixl_agent_config(backends=[]))
        finally:
            _api.nixlBind.nixlAgentConfig = real
    agent.create_backend("UCX", {"num_workers": str(workers)})
    return agent


def _descriptors(local: np.ndarray, remote: np.ndarray, length: int,
                 piece_blocks: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NIXL descriptor lists ``(addr, length, device)`` for blocks of ``length`` bytes, each run of blocks
    contiguous on both sides merged into one descriptor (consecutive slots usually are: one UCX operation
    instead of one per block), none across a multiple of ``piece_blocks`` (when set); and the index of each
    descriptor's first block."""
    n = len(local)
    starts = np.ones(n, dtype=bool)
    starts[1:] = (local[1:] != local[:-1] + np.uint64(length)) | (remote[1:] != remote[:-1] + np.uint64(length))
    if piece_blocks:
        starts[::piece_blocks] = True
    first = np.flatnonzero(starts)
    sizes = np.diff(np.append(first, n)).astype(np.uint64) * np.uint64(length)
    out = []
    for addrs in (local, remote):
        d = np.zeros((len(first), 3), dtype=np.uint64)
        d[:, 0] = addrs[first]
        d[:, 1] = sizes
        out.append(d)
    return out[0], out[1], first


def lane_descriptors(local: np.ndarray, remote: np.ndarray, length: int, lanes: int
                     ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The blocks (addresses of ``length``-byte blocks, in order) cut into at most ``lanes`` groups of
    consecutive blocks of equal count, each as its NIXL descriptor lists (:func:`_descriptors`): one transfer
    request per lane."""
    return [_descriptors(lo, re, length)[:2]
            for lo, re in zip(np.array_split(local, lanes), np.array_split(remote, lanes)) if len(lo)]


def lane_pieces(local: np.ndarray, remote: np.ndarray, length: int, lanes: int, tag: bytes, piece_bytes: int
                ) -> list[list[tuple[np.ndarray, np.ndarray, bytes]]]:
    """Per lane (as :func:`lane_descriptors` cuts them), its transfer requests in order: descriptor lists and
    notification message. Without ``tag`` (or ``piece_bytes``), one request per lane, notifying nothing; with
    them, the lane's blocks in pieces of at most ``piece_bytes`` (at least one block), each notifying
    :func:`landed_message` of its first block's index (in all the blocks) and its block count."""
    if not tag or not piece_bytes:
        return [[(lo, re, b"")] for lo, re in lane_descriptors(local, remote, length, lanes)]
    per = max(1, piece_bytes // length)
    out = []
    offset = 0  # index of the lane's first block
    for lo, re in zip(np.array_split(local, lanes), np.array_split(remote, lanes)):
        n = len(lo)
        if not n:
            continue
        local_d, remote_d, first = _descriptors(lo, re, length, per)
        cuts = np.searchsorted(first, np.arange(0, n + per, per)).tolist()  # each piece's first descriptor
        out.append([(local_d[a:b], remote_d[a:b], landed_message(tag, offset + i * per, min(per, n - i * per)))
                    for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if b > a])
        offset += n
    return out


class TransferFailed(Exception):
    """``may_still_write``: the destination may still change. ``released``: NIXL released (cancelled) the
    request, so this process will not move its bytes any more (bytes UCX already handed to a TCP socket may
    still arrive); False when NIXL could not release it (or it is not known), and then this process may
    move them at any time until it exits."""

    def __init__(self, reason: str, *, may_still_write: bool = False, released: bool = False) -> None:
        super().__init__(reason)
        self.may_still_write = may_still_write
        self.released = released


class NotPosted(TransferFailed):
    """No request of the transfer was posted by its deadline (it waited for a thread, or for the peer's share of
    them): nothing moved, nothing will, and the peer's endpoint is left as it was."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, released=True)


class LandingArenasFull(Unavailable):
    """This node keeps as many landing arenas as it may: none for one more source until its agent is replaced."""


class Transport(abc.ABC):
    agent_name: str

    async def ready(self, timeout_s: float) -> None:
        """Returns once the transport can be used; Unavailable if it cannot be within ``timeout_s``."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to read this node's region (a ``serve_peer_reads`` source hands it out): connection
        info and the region, no landing arena."""

    @abc.abstractmethod
    def landing_metadata(self, node_id: str) -> bytes:
        """What source node ``node_id`` is handed in a handshake: this agent's connection info and the landing
        arena kept for that node, nothing else of this node's memory (the arena is made at the first call);
        LandingArenasFull when the agent may keep no arena more (:meth:`rotate` drops them all)."""

    @abc.abstractmethod
    def landing_arena(self, node_id: str) -> LandingArena | None:
        """The arena :meth:`landing_metadata` described to source node ``node_id`` (None before that)."""

    @abc.abstractmethod
    def renew_landing_arena(self, node_id: str) -> bool:
        """Retires source node ``node_id``'s arena (kept registered and mapped, so a write still in flight lands
        there, its pages given back to the OS, never used again while the agent lives): its next
        :meth:`landing_metadata` makes a fresh one. False when that node's arena was renewed as often as this
        agent allows (or it has none)."""

    @abc.abstractmethod
    def describe_peer(self, metadata: bytes) -> AgentMetadata:
        """What a peer's metadata says (agent name, registered memory), read without loading it;
        InvalidArgument when it is not exactly what an agent of this transport hands out."""

    @abc.abstractmethod
    async def vet_peer(self, metadata: bytes, timeout_s: float) -> None:
        """Checks that loading a peer's metadata (one :meth:`describe_peer` accepted) cannot bring this process
        down; InvalidArgument when it would, Unavailable when the check did not end within ``timeout_s``."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Loads a peer's metadata (one :meth:`vet_peer` passed); returns its agent name. Idempotent."""

    @abc.abstractmethod
    def notify(self, agent_name: str, message: bytes) -> None:
        """Sends ``message`` to a loaded peer agent (a NIXL notification: it reaches the process behind the
        agent's worker address, whoever handed over the metadata). Unavailable when it cannot be sent."""

    @abc.abstractmethod
    async def notification(self, sender: str, timeout_s: float, digest: bytes = b"") -> bytes | None:
        """The latest notification this node's agent received from agent ``sender`` (taken), waiting at most
        ``timeout_s`` for one; None if none came. With ``digest``, only one whose SHA-256 it is (an earlier
        one arriving late is not taken for it)."""

    @abc.abstractmethod
    def remove_peer(self, agent_name: str) -> None:
        """Forgets a peer and closes its endpoint (no-op if unknown); a transfer still in flight to it
        finishes first."""

    @abc.abstractmethod
    async def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], length: int,
                   timeout_s: float) -> None:
        """READs ``length`` bytes at each remote address into each local address (of a landing arena)."""

    @abc.abstractmethod
    async def write(self, peer: str, local_offsets: list[int], remote_addrs: list[int], length: int,
                    timeout_s: float, tag: bytes = b"") -> None:
        """WRITEs ``length`` bytes at each local offset to the peer's memory at each remote address. With
        ``tag``, the peer may learn of pieces that have landed before the whole WRITE ends (:meth:`landed`)."""

    @contextlib.contextmanager
    def landed(self, sender: str, tag: bytes, on_landed: OnLanded) -> Iterator[None]:
        """While inside: ``on_landed(first, count)`` (on the event loop) for each piece of a WRITE tagged ``tag``
        that agent ``sender`` reports landed here, blocks ``first`` to ``first + count - 1`` of it. A hint of
        when to look, never proof of what arrived (anyone who can reach this node's agent could send one): the
        caller checks the bytes and still waits for the WRITE's end. By default no piece is reported."""
        yield

    async def rotate(self) -> bool:
        """Replaces the local agent so that nothing addressed to the old one can land; False when it cannot
        (not supported, or not now)."""
        return False

    @abc.abstractmethod
    def close(self) -> None: ...


class NixlTransport(Transport):
    """NIXL agent with the UCX backend, the node's region registered as DRAM.

    Importing NIXL and creating the agent take from under a second to over ten on a loaded host, so
    they run in a thread started here: the node serves its local API at once, and peer work waits
    for :meth:`ready` (bounded by each request's own deadline).
    """

    def __init__(self, node_id: str, region: SharedRegion, progress_wait_ms: int = 100, lanes: int = 1,
                 piece_bytes: int = 0, landing_slots: int = 0, max_landing_sources: int = 64,
                 landing_renewals: int = 4) -> None:
        """``lanes``: transfer requests one read or write is split into, posted at once from as many threads,
        each with a UCX worker of its own; ``piece_bytes``: the most bytes of one request of a tagged write, each
        reported landed to the peer by a NIXL notification (0: tagged writes go as untagged ones, one request per
        lane, and report nothing); ``landing_slots``: blocks of one source's landing arena (0: as many as the
        region holds); ``max_landing_sources``: source nodes given an arena per agent; ``landing_renewals``: times
        one source's arena may be renewed per agent."""
        self._piece_bytes = piece_bytes
        self._landing_slots = landing_slots or region.num_slots
        self._max_landing_sources = max_landing_sources
        self._arenas: dict[str, tuple[LandingArena, object]] = {}  # source node -> its arena, NIXL registration
        self._landing_renewals = landing_renewals
        self._renewed: list[tuple[LandingArena, object]] = []  # retired arenas: registered and mapped until rotate()
        self._renewals: collections.Counter[str] = collections.Counter()  # source node -> its arenas retired
        # A fresh name per start (and per rotate()): peers holding an old agent's metadata must re-handshake.
        self._node_id = node_id
        self._progress_wait_ms = progress_wait_ms
        self._lanes = max(1, lanes)
        self.agent_name = agent_name(node_id)
        self._region = region
        self._agent = None
        self._reg = None
        self._peers: set[str] = set()
        self._busy: dict[str, int] = {}  # transfers in flight per peer
        self._retired: set[str] = set()  # removed while busy: closed when its last transfer ends
        self._notes: dict[str, bytes] = {}  # sender agent -> its latest notification not taken yet
        self._landings: dict[tuple[str, bytes], OnLanded] = {}  # (sender agent, tag) -> who is told of pieces
        self._landings_pump: asyncio.Task | None = None  # reads notifications while anyone waits for pieces
        self._unreleased = 0  # transfers NIXL could not release: they may move bytes until this process exits
        self._rotating = False
        self._built: concurrent.futures.Future = concurrent.futures.Future()
        self._threads = self._new_threads()  # the agent's transfers are posted and polled in these only
        self._peer_lanes = max(self._lanes, self._thread_count() // _PEER_SHARE_OF_THREADS)
        self._lanes_held: collections.Counter[str] = collections.Counter()  # peer node -> its lanes queued or running
        self._lane_waiters: list[asyncio.Future] = []  # transfers waiting for their peer's share of the threads
        self._vetter = MetadataVetter()  # its own NIXL agent: started now, beside this one
        threading.Thread(target=self._build, args=(progress_wait_ms,), name="nixl-agent", daemon=True).start()

    def _build(self, progress_wait_ms: int) -> None:
        t0 = time.monotonic()
        try:
            agent, self._reg = self._new_agent(self.agent_name)
        except BaseException as exc:  # noqa: BLE001 - reported to every caller of ready()
            log.error("creating the NIXL agent failed: %s; this node can neither pull nor serve pulls", exc)
            self._built.set_exception(exc)
            return
        self._agent = agent
        log.info("NIXL agent %s ready in %.2fs", self.agent_name, time.monotonic() - t0)
        self._built.set_result(None)

    def _thread_count(self) -> int:
        return max(8, _XFER_THREADS_PER_LANE * self._lanes)

    def _new_threads(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(self._thread_count(), thread_name_prefix="nixl-transfer")

    def _new_agent(self, name: str):
        agent = new_nixl_agent(name, self._progress_wait_ms, self._lanes)
        return agent, agent.register_memory([(self._region.base_addr, self._region.size, 0, "")], "DRAM")

    async def rotate(self) -> bool:
        if self._agent is None or self._busy or self._unreleased or self._rotating:
            return False
        self._rotating = True  # no transfer starts until the new agent is in place
        try:
            name = agent_name(self._node_id)
            t0 = time.monotonic()
            agent, reg = await asyncio.to_thread(self._new_agent, name)
            # the old arenas go with the old agent, after it (a WRITE its worker still serves must land in mapped
            # memory); a pull that holds one keeps it mapped until it is done; sources get new ones at handshake
            arenas = [*self._arenas.values(), *self._renewed]
            old = [self._agent, [self._reg, *(r for _, r in arenas)], [a for a, _ in arenas]]
            old_threads, self._threads = self._threads, self._new_threads()
            self._agent, self._reg, self.agent_name = agent, reg, name
            self._arenas.clear()
            self._renewed.clear()
            self._renewals.clear()
            self._peers.clear()
            self._retired.clear()
            await asyncio.to_thread(self._destroy, old)
            old_threads.shutdown(wait=False)  # idle (nothing was in flight): their worker bindings go with them
        finally:
            self._rotating = False
        log.warning("NIXL agent replaced by %s in %.2fs: no transfer naming the old one can land any more; every "
                    "peer handshakes again", name, time.monotonic() - t0)
        return True

    @staticmethod
    def _destroy(old: list) -> None:
        """Deregisters the region and the landing arenas from an old agent and drops the last reference to it
        (its UCX workers, endpoints and sockets close with it), then to its arenas (unmapped after the agent)."""
        agent, regs, arenas = old
        old.clear()
        for reg in regs:
            try:
                agent.deregister_memory(reg)
            except Exception as exc:  # noqa: BLE001 - the agent goes anyway
                log.warning("deregistering memory from the old NIXL agent: %s", exc)
        del agent, regs
        del arenas

    async def ready(self, timeout_s: float) -> None:
        """The agent is built and so is the metadata vetter's (a peer's handshake needs both)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self._agent is not None and self._vetter.ready:  # every pull and handshake asks: no task once up
            return
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._built)), max(0.0, timeout_s))
        except TimeoutError:
            raise Unavailable("the NIXL agent is still starting") from None
        except Exception as exc:  # noqa: BLE001 - the agent could not be created
            raise Unavailable(f"no NIXL agent: {exc}") from None
        if not await self._vetter.started(deadline - time.monotonic()):
            raise Unavailable("the process that checks peers' agent metadata is still starting")

    def _ready_agent(self):
        if self._agent is None:
            raise Unavailable("the NIXL agent is not ready")
        return self._agent

    def metadata(self) -> bytes:
        return self._ready_agent().get_partial_agent_metadata(self._reg, True, ["UCX"])  # the region, no arena

    def landing_metadata(self, node_id: str) -> bytes:
        agent = self._ready_agent()
        entry = self._arenas.get(node_id)
        if entry is None:
            if len(self._arenas) >= self._max_landing_sources:
                raise LandingArenasFull(
                    f"this node keeps landing arenas for {len(self._arenas)} source nodes already, none for "
                    f"{node_id!r} until its NIXL agent is replaced (raise max_landing_sources to do that less often)")
            arena = LandingArena(node_id, self._landing_slots, self._region.block_bytes)
            try:
                reg = agent.register_memory([(arena.base_addr, arena.size, 0, "")], "DRAM")
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own classes
                raise Unavailable(f"registering a landing arena for {node_id!r}: {exc}") from None
            entry = self._arenas[node_id] = (arena, reg)
            log.info("landing arena of %d blocks (%.1f MiB) for source %s", arena.slots, arena.size / 2**20, node_id)
        return agent.get_partial_agent_metadata(entry[1], True, ["UCX"])

    def landing_arena(self, node_id: str) -> LandingArena | None:
        entry = self._arenas.get(node_id)
        return None if entry is None else entry[0]

    def renew_landing_arena(self, node_id: str) -> bool:
        if node_id not in self._arenas or self._renewals[node_id] >= self._landing_renewals:
            return False
        entry = self._arenas.pop(node_id)
        self._renewed.append(entry)
        self._renewals[node_id] += 1
        entry[0].release_pages()
        log.warning("landing arena of source %s renewed (%d of %d times this agent allows): the old one stays "
                    "registered, its pages given back", node_id, self._renewals[node_id], self._landing_renewals)
        return True

    def describe_peer(self, metadata: bytes) -> AgentMetadata:
        return read_agent_metadata(metadata)

    async def vet_peer(self, metadata: bytes, timeout_s: float) -> None:
        await self._vetter.check(metadata, timeout_s)

    def add_peer(self, metadata: bytes) -> str:
        agent = self._ready_agent()
        try:
            name = agent.add_remote_agent(metadata)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own classes for metadata it cannot load
            log.info("refusing agent metadata NIXL cannot load: %s", exc)
            raise InvalidArgument("agent_metadata is not a NIXL agent's metadata (as get_agent_metadata() "
                                  "returns it)") from None
        name = name.decode() if isinstance(name, bytes) else name
        self._peers.add(name)
        self._retired.discard(name)  # re-added before its old endpoint could close: that endpoint stays
        return name

    def notify(self, agent_name: str, message: bytes) -> None:
        try:
            self._ready_agent().send_notif(agent_name, message)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own classes
            raise Unavailable(f"cannot notify agent {agent_name!r}: {exc}") from None

    def _take_notifications(self) -> None:
        """Reads what the agent received: pieces landed go to whoever waits for them (others are dropped), the
        latest other notification of each sender is kept for :meth:`notification`."""
        agent = self._agent
        if agent is None:
            return
        for name, messages in agent.get_new_notifs().items():
            others = [m for m in messages if not m.startswith(_LANDED)]
            if len(others) < len(messages):
                for message in messages:
                    if message.startswith(_LANDED):
                        self._piece_landed(name, message)
            if others:
                if len(self._notes) >= _MAX_NOTES and name not in self._notes:
                    self._notes.pop(next(iter(self._notes)))  # the oldest sender's: nobody took it
                self._notes[name] = others[-1]

    def _piece_landed(self, sender: str, message: bytes) -> None:
        tag, _, rest = message[len(_LANDED):].partition(b":")
        on_landed = self._landings.get((sender, tag))
        first, _, count = rest.partition(b":")
        if on_landed is not None and first.isdigit() and count.isdigit():
            on_landed(int(first), int(count))

    @contextlib.contextmanager
    def landed(self, sender: str, tag: bytes, on_landed: OnLanded) -> Iterator[None]:
        key = (sender, tag)
        self._landings[key] = on_landed
        if self._landings_pump is None or self._landings_pump.done():
            self._landings_pump = asyncio.get_running_loop().create_task(self._pump_landings())
        try:
            yield
        finally:
            if self._landings.get(key) is on_landed:
                del self._landings[key]

    async def _pump_landings(self) -> None:
        while self._landings:
            try:
                self._take_notifications()
            except Exception as exc:  # noqa: BLE001 - a waiter's callback or NIXL; pieces are only hints
                log.warning("reading NIXL notifications: %s", exc)
            await asyncio.sleep(_LANDED_POLL_S)

    async def notification(self, sender: str, timeout_s: float, digest: bytes = b"") -> bytes | None:
        self._ready_agent()
        deadline = time.monotonic() + timeout_s
        while True:
            self._take_notifications()
            note = self._notes.get(sender)
            if note is not None and (not digest or hashlib.sha256(note).digest() == digest):
                return self._notes.pop(sender)
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(_NOTE_POLL_S)

    def remove_peer(self, agent_name: str) -> None:
        if agent_name not in self._peers:
            return
        self._peers.discard(agent_name)
        if self._busy.get(agent_name):
            self._retired.add(agent_name)  # NIXL must not drop an endpoint under a transfer it is running
            return
        self._invalidate(agent_name)

    def _invalidate(self, agent_name: str) -> None:
        try:
            self._agent.remove_remote_agent(agent_name)  # NIXL drops the endpoint (UCX may keep its socket)
        except Exception as exc:  # noqa: BLE001 - forgetting a dead peer must not fail
            log.warning("removing NIXL peer %s: %s", agent_name, exc)

    async def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], length: int,
                   timeout_s: float) -> None:
        await self._xfer("READ", peer, np.asarray(local_addrs, dtype=np.uint64), remote_addrs, length, timeout_s)

    async def write(self, peer: str, local_offsets: list[int], remote_addrs: list[int], length: int,
                    timeout_s: float, tag: bytes = b"") -> None:
        local = np.asarray(local_offsets, dtype=np.uint64) + np.uint64(self._region.base_addr)
        await self._xfer("WRITE", peer, local, remote_addrs, length, timeout_s, tag)

    async def _xfer(self, op: str, peer: str, local_addrs: np.ndarray, remote_addrs: list[int], length: int,
                    timeout_s: float, tag: bytes = b"") -> None:
        if peer not in self._peers or self._rotating:
            raise TransferFailed(f"unknown peer agent {peer!r}" if peer not in self._peers else
                                 "the NIXL agent is being replaced")
        lanes = lane_pieces(local_addrs, np.asarray(remote_addrs, dtype=np.uint64), length, self._lanes, tag,
                            self._piece_bytes)
        deadline = time.monotonic() + timeout_s
        self._busy[peer] = self._busy.get(peer, 0) + 1
        try:
            await self._take_lanes(op, peer, len(lanes), deadline)
            outcomes = await self._run_lanes(op, peer, lanes, deadline)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                unexpected = next((o for o in failed if not isinstance(o, TransferFailed)), None)
                if unexpected is not None:
                    raise unexpected
                if len(failed) == len(outcomes) and all(isinstance(o, NotPosted) for o in failed):
                    raise NotPosted("; ".join(str(o) for o in failed))
                raise TransferFailed("; ".join(str(o) for o in failed),
                                     may_still_write=any(o.may_still_write for o in failed),
                                     released=all(o.released for o in failed))
        except NotPosted:
            raise
        except TransferFailed:
            log.info("%s with %s failed: closing its endpoint (the next transfer needs a new handshake)", op, peer)
            self.remove_peer(peer)
            raise
        finally:
            self._busy[peer] -= 1
            if not self._busy[peer]:
                del self._busy[peer]
                if peer in self._retired:
                    self._retired.discard(peer)
                    self._invalidate(peer)

    async def _take_lanes(self, op: str, peer: str, n: int, deadline: float) -> None:
        """Waits, until the transfer's deadline, for ``n`` lanes within the peer node's share of the transfer
        threads (its agents together: a node that handshakes again is one peer still): a node that stopped
        answering (or stalls on purpose) holds its share until its transfers' bounds, and every other node's
        transfers still find threads."""
        node = node_of_agent(peer) or peer
        while self._lanes_held[node] + n > self._peer_lanes:
            freed = asyncio.get_running_loop().create_future()
            self._lane_waiters.append(freed)
            try:
                await asyncio.wait_for(freed, deadline - time.monotonic())
            except TimeoutError:
                raise NotPosted(f"{op} with {peer} timed out behind its node's {self._lanes_held[node]} lanes in "
                                "flight (nothing was posted)") from None
            finally:
                with contextlib.suppress(ValueError):
                    self._lane_waiters.remove(freed)
        self._lanes_held[node] += n

    def _lane_ended(self, peer: str) -> None:
        node = node_of_agent(peer) or peer
        self._lanes_held[node] -= 1
        if self._lanes_held[node] <= 0:
            del self._lanes_held[node]
        waiters, self._lane_waiters = self._lane_waiters, []
        for freed in waiters:
            if not freed.done():
                freed.set_result(None)

    async def _run_lanes(self, op: str, peer: str, lanes: list, deadline: float) -> list:
        """Runs each lane in a transfer thread and waits for every one that started to end (within its bound,
        failed or not); a lane no thread has started by the deadline never starts: it fails, nothing posted."""
        loop = asyncio.get_running_loop()
        started: list[concurrent.futures.Future] = []
        for pieces in lanes:
            lane = self._threads.submit(self._xfer_blocking, op, peer, pieces, deadline)
            lane.add_done_callback(lambda _, peer=peer: loop.call_soon_threadsafe(self._lane_ended, peer))
            started.append(lane)
        waited = [asyncio.wrap_future(lane) for lane in started]
        try:
            if waited:
                await asyncio.wait(waited, timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for lane in started:
                lane.cancel()  # only one still queued: no thread took it by its deadline
        outcomes = await asyncio.gather(*waited, return_exceptions=True)
        return [NotPosted(f"{op} with {peer} timed out waiting for a transfer thread (nothing was posted)")
                if isinstance(o, asyncio.CancelledError) else o for o in outcomes]

    def _xfer_blocking(self, op: str, peer: str, pieces: list[tuple[np.ndarray, np.ndarray, bytes]],
                       deadline: float) -> None:
        """One lane's requests, in order, up to ``_PIECES_IN_FLIGHT`` posted at once (so the path never idles
        between pieces; each piece's notification leaves when it has landed); the first that fails ends the lane
        (those still in flight are released, and may still have written), and none is posted past the
        deadline."""
        posted: collections.deque = collections.deque()
        try:
            for i, (local, remote, message) in enumerate(pieces):
                if len(posted) >= _PIECES_IN_FLIGHT:
                    self._finish_piece(op, peer, posted.popleft(), deadline)
                if time.monotonic() >= deadline:
                    if not i:
                        raise NotPosted(f"{op} with {peer} timed out before it began")
                    while posted:
                        self._finish_piece(op, peer, posted.popleft(), deadline)
                    raise TransferFailed(f"{op} with {peer} timed out after {i} of its {len(pieces)} requests",
                                         released=True)
                posted.append(self._post_piece(op, peer, local, remote, message))
            while posted:
                self._finish_piece(op, peer, posted.popleft(), deadline)
        except TransferFailed as exc:
            for handle, _ in posted:  # cancelled, but bytes already handed to a socket may still land
                exc.released = self._release(handle) and exc.released
                exc.may_still_write = True
            raise

    def _post_piece(self, op: str, peer: str, local: np.ndarray, remote: np.ndarray, message: bytes
                    ) -> tuple[object, str]:
        """Posts one request: (its handle, its state)."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), peer, message)
        except Exception as exc:  # noqa: BLE001 - every NIXL failure is a failed transfer
            raise TransferFailed(f"preparing the {op} with {peer} failed: {exc}", released=True) from exc
        try:
            return handle, agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError
            released = self._release(handle)
            raise TransferFailed(f"{op} with {peer} failed: {exc}", may_still_write=not released,
                                 released=released) from exc

    def _finish_piece(self, op: str, peer: str, posted: tuple[object, str], deadline: float) -> None:
        """Waits, until the deadline, for a posted request to end, and releases it."""
        handle, state = posted
        agent = self._agent
        try:
            spins = 0
            while state == "PROC":
                state = agent.check_xfer_state(handle)  # polled once at least: a piece posted ahead may be done
                if state != "PROC":
                    break
                if time.monotonic() >= deadline:
                    # Released or not, bytes UCX already handed to a TCP socket still land when the path
                    # drains (after a cut heals, or a collapsed congestion window catches up; measured in
                    # the fault matrix): the destination may still change.
                    raise TransferFailed(f"{op} with {peer} timed out", may_still_write=True,
                                         released=self._release(handle))
                spins += 1
                if spins > _SPINS_BEFORE_SLEEP:
                    time.sleep(_POLL_SLEEP_S)
            if state != "DONE":
                raise TransferFailed(f"{op} with {peer} failed ({state})")
        except TransferFailed as exc:
            if not exc.may_still_write:
                exc.released = self._release(handle)
                exc.may_still_write = not exc.released
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError
            released = self._release(handle)
            raise TransferFailed(f"{op} with {peer} failed: {exc}", may_still_write=not released,
                                 released=released) from exc
        self._release(handle)

    def _release(self, handle) -> bool:
        """Releases (cancelling if active); False when NIXL could not cancel it."""
        try:
            handle.release()
            return True
        except Exception as exc:  # noqa: BLE001
            log.error("could not release a NIXL transfer: %s", exc)
            self._unreleased += 1
            return False

    def close(self) -> None:
        if self._landings_pump is not None:
            self._landings_pump.cancel()
        self._vetter.close()
        self._threads.shutdown(wait=False)  # a transfer still polling ends within its own bound
        try:
            self._built.result()  # the region must not be unmapped while the agent registers it
        except Exception:  # noqa: BLE001 - nothing was registered
            return
        for peer in list(self._peers):
            self.remove_peer(peer)
        for reg in [self._reg, *(r for _, r in [*self._arenas.values(), *self._renewed])]:
            try:
                self._agent.deregister_memory(reg)
            except Exception as exc:  # noqa: BLE001 - shutting down
                log.warning("deregistering memory: %s", exc)
        self._agent = None  # before the arenas: memory its worker could still write into stays mapped until then
        self._arenas.clear()
        self._renewed.clear()
