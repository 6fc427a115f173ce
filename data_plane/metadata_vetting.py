"""A peer's NIXL agent metadata is loaded first by a throwaway agent in a child process.

The connection part of an agent's metadata is UCX's packed worker address, opaque to
:func:`data_plane.nixl_metadata.read_agent_metadata`. UCX aborts the whole process on some malformed
addresses: one flipped byte (the address's version) trips an assertion in its address unpacking
(``address.c: Assertion `*addr_version == UCP_OBJECT_VERSION_V2' failed``), so any grant holder could
kill a source with one handshake. A data plane therefore hands NIXL a peer's metadata only after
:class:`MetadataVetter`'s child loaded (and unloaded) it in an agent of its own: when the child dies doing
so, the metadata is refused and only the child is lost; the next handshake gets a new one. A child that NIXL
refused is replaced too (NIXL may keep a half-loaded agent name, which would refuse the real metadata later).
From the first replacement on, a spare child is kept started beside the one in use, so that a further replacement
(seconds of CPU to build a NIXL agent) is not paid on the next handshake's path.

Each such failure costs the node a new child, so any grant holder could keep a source busy respawning them, and
the checks run one at a time. :class:`HandshakeGate` bounds that per consumer node (the node id the caller's grant
proves): one check in flight per node, and after metadata that failed the check, that node's handshakes are refused
for a cooldown that doubles with each failure (1 s up to 60 s).

Protocol on the child's stdin/stdout (stdout is the child's fd 1 before it points fd 1 at stderr, so
NIXL's and UCX's own output never mixes in): the child writes ``R`` once its agent exists; then for each
``<u32 length><metadata>`` it reads, it writes ``1`` (loaded) or ``0`` (NIXL refused it).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import select
import struct
import subprocess
import sys
import threading
import time
import uuid

from kvmesh.errors import InvalidArgument, ResourceExhausted, Unavailable

_LENGTH = struct.Struct("<I")
READY, LOADED, REFUSED = b"R", b"1", b"0"


def _ready_by(fd: int, event: int, deadline: float) -> bool:
    """Whether ``fd`` is ready for ``event`` (POLLIN, POLLOUT) before ``deadline`` (poll, not select: a busy data
    plane's descriptors pass 1,023, where select() raises)."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))


# Set (by the caller, in its own context: asyncio.to_thread carries it into vet's thread) for metadata of a node whose
# metadata failed the check before: it is checked only while a started spare can take over at once should it kill or
# jam the child, so a node that failed before never puts a child's start on another handshake's path.
ONLY_WITH_A_SPARE: contextvars.ContextVar[bool] = contextvars.ContextVar("kvmesh_vet_only_with_a_spare",
                                                                          default=False)


class SpareStarting(ResourceExhausted):
    """Metadata checked only with a started spare (:data:`ONLY_WITH_A_SPARE`) while the spare is still starting."""


class StuckCheck(Unavailable):
    """The checking process was handed the metadata and gave no answer by the deadline (it is replaced)."""


class MetadataVetter:
    """The parent's side: a child with a NIXL agent, started at once (it takes seconds), replaced after each
    refusal or death by a spare started beforehand (``spare``: once the child in use is up, after a first
    replacement). One metadata at a time."""

    def __init__(self, spare: bool = True) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._spare: subprocess.Popen | None = None
        self._keep_spare = spare
        self._ready = False
        self.deaths = 0  # children that died loading a metadata (each one refused)
        self.replaced = 0  # children replaced (after a refusal, a death or no answer)
        self._start()

    @staticmethod
    def _spawn() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "data_plane.metadata_vetting"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, bufsize=0)

    def _start(self) -> None:
        self._proc = self._spawn()
        self._ready = False

    @staticmethod
    def _end(proc: subprocess.Popen | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _replace(self) -> None:
        """The spare takes over (already up, in the common case: no wait for it); a new spare starts."""
        self._end(self._proc)
        self.replaced += 1
        spare, self._spare = self._spare, None
        if spare is None or spare.poll() is not None:
            self._start()  # none started yet (or it died): this one starts now, the next spare once it is up
            return
        self._proc, self._ready = spare, False
        try:
            self._ready = self._answer(time.monotonic()) == READY  # up already: its READY waits in the pipe
        except OSError:
            self._ready = False
        self._top_up()

    def _spare_up(self) -> bool:
        """Whether a spare exists and its agent is up (its READY byte waits in the pipe, left for :meth:`_replace`)."""
        spare = self._spare
        return spare is not None and spare.poll() is None and _ready_by(spare.stdout.fileno(), select.POLLIN,
                                                                        time.monotonic())

    def _top_up(self) -> None:
        """Starts a spare once the child in use is up (two NIXL agents starting at once would slow the first), from
        the first replacement on: a node never handed metadata that failed the check keeps one agent (a spare is a
        NIXL agent more: seconds of CPU to start, ~250 MB)."""
        if not self._keep_spare or not self._ready or not self.replaced:
            return
        if self._spare is not None and self._spare.poll() is not None:
            self._spare = None  # it died (reaped by poll())
        if self._spare is None:
            try:
                self._spare = self._spawn()
            except OSError:  # e.g. out of descriptors or processes: no spare this time, the next check tries again
                self._spare = None

    def _answer(self, deadline: float) -> bytes:
        """The child's next byte: b"" when it died, b"?" when ``deadline`` passed first."""
        fd = self._proc.stdout.fileno()
        if not _ready_by(fd, select.POLLIN, deadline):
            return b"?"
        return os.read(fd, 1)

    def _send(self, data: bytes, deadline: float) -> bool:
        """Writes ``data`` to the child; False when ``deadline`` passed first (a stopped child reads nothing, and
        a metadata larger than the pipe's buffer blocked the write, the lock and the thread for good)."""
        fd = self._proc.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(data)
        while view:
            if not _ready_by(fd, select.POLLOUT, deadline):
                return False
            view = view[os.write(fd, view):]
        return True

    def vet(self, metadata: bytes, timeout_s: float) -> None:
        """Returns when a throwaway agent loaded ``metadata``; InvalidArgument when NIXL refused it or loading it
        killed the child, Unavailable when no answer came within ``timeout_s``, behind other vets included
        (blocking: run it in a thread). :class:`StuckCheck` (an Unavailable) when the child was handed the
        metadata (or part of it) and did not answer in time."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            raise Unavailable("this node could not check the agent metadata in time (other handshakes' checks "
                              "held its checking process); try the handshake again")
        handed = False  # whether the child was handed any of the metadata
        try:
            if self._proc.poll() is not None:
                self._replace()
            answer = b""
            try:
                if not self._ready:
                    answer = self._answer(deadline)
                    self._ready = answer == READY
                if self._ready:
                    self._top_up()
                    if ONLY_WITH_A_SPARE.get() and self._keep_spare and not self._spare_up():
                        raise SpareStarting("this node's spare process for checking agent metadata is still "
                                            "starting (a node whose metadata failed the check before waits for "
                                            "it); retry in a few seconds")
                    handed = True
                    sent = self._send(_LENGTH.pack(len(metadata)) + metadata, deadline)
                    answer = self._answer(deadline) if sent else b"?"
            except OSError:  # the child is gone (broken pipe)
                answer = b""
            if answer == LOADED:
                return
            if self._ready or self._proc.poll() is not None:  # a child still starting is left to start
                self._replace()
        finally:
            self._lock.release()
        if answer == b"?":
            if handed:
                raise StuckCheck("this node could not check the agent metadata in time (its checking process was "
                                 "handed it and gave no answer); try the handshake again")
            raise Unavailable("this node could not check the agent metadata in time (its checking process is "
                              "still starting or stuck); try the handshake again")
        if not handed:  # it died before it was handed anything: not this metadata's doing
            raise Unavailable("this node's checking process for agent metadata died while starting (a new one is "
                              "starting); try the handshake again")
        if answer == REFUSED:
            raise InvalidArgument("agent_metadata: NIXL cannot load it (as get_agent_metadata() returns it)")
        self.deaths += 1
        raise InvalidArgument("agent_metadata: loading it crashed a NIXL agent (a throwaway process that loaded it "
                              "first died): refused")

    def wait_started(self, timeout_s: float) -> bool:
        """Whether the child's agent exists, waiting for it at most ``timeout_s`` (blocking: run it in a thread).
        Its start takes seconds on a busy machine: a node counts as ready for handshakes only once it is up, so
        that cost is paid at start, not by the first pull's bound."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            return self._ready
        try:
            if self._proc.poll() is not None:
                self._replace()
            if not self._ready:
                try:
                    self._ready = self._answer(deadline) == READY
                except OSError:
                    self._ready = False
            self._top_up()
            return self._ready
        finally:
            self._lock.release()

    @property
    def ready(self) -> bool:
        """Whether the checking process answered that it started (and has not failed since)."""
        return self._ready

    async def started(self, timeout_s: float) -> bool:
        """:meth:`wait_started` off the event loop (no thread once started: every pull asks)."""
        return self._ready or await asyncio.to_thread(self.wait_started, timeout_s)

    async def check(self, metadata: bytes, timeout_s: float) -> None:
        """:meth:`vet` off the event loop."""
        await asyncio.to_thread(self.vet, metadata, timeout_s)

    def close(self) -> None:
        for proc in (self._proc, self._spare):
            if proc is not None and proc.poll() is None:
                proc.stdin.close()  # the child ends on end of input
                try:
                    proc.wait(2.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


COOLDOWN_FIRST_S = 1.0  # a node's handshakes are refused this long after its first metadata that failed the check
COOLDOWN_MAX_S = 60.0  # the cooldown doubles with each further failure, up to this
COOLDOWN_FORGET_S = 600.0  # each this long without a failure, a node's count of failures drops by one
MAX_COOLING_NODES = 4096  # nodes whose failures are remembered (beyond it, the earliest failure is forgotten)


class HandshakeGate:
    """Per consumer node (the node id the caller's grant proves): at most one metadata check in flight, and after
    metadata that failed the check (NIXL refused it, it crashed the checking process, or that process gave no
    answer), the node's handshakes are refused (ResourceExhausted) for a cooldown: ``first_s`` after one failure,
    doubling with each further one up to ``max_s``. Every failure costs the source a new checking process (seconds
    of CPU), so a grant holder may cost it one per cooldown, not one per call. A success does not reset the count
    (an attacker with a real agent could alternate failures and successes): it decays by one every ``forget_s``
    without a failure, and a node whose count is back at zero is forgotten. At most ``max_nodes`` nodes are kept.
    A node with failures is checked only while a spare checking process is up (:data:`ONLY_WITH_A_SPARE`), so its
    next crash costs no other handshake a child's start either. The event loop's thread only."""

    def __init__(self, first_s: float = COOLDOWN_FIRST_S, max_s: float = COOLDOWN_MAX_S,
                 forget_s: float = COOLDOWN_FORGET_S, max_nodes: int = MAX_COOLING_NODES) -> None:
        self._first_s, self._max_s, self._forget_s, self._max_nodes = first_s, max_s, forget_s, max_nodes
        self._failures: dict[str, tuple[int, float, float]] = {}  # node -> (count, refused until, last failure)
        self._checking: set[str] = set()

    def _count(self, node_id: str, now: float) -> int:
        """``node_id``'s failures, decayed to ``now``."""
        entry = self._failures.get(node_id)
        return 0 if entry is None else max(0, entry[0] - int((now - entry[2]) // self._forget_s))

    def enter(self, node_id: str) -> bool:
        """Before ``node_id``'s metadata is checked: ResourceExhausted while it cools down or has a check in flight;
        otherwise the check counts as in flight until :meth:`leave`. Whether ``node_id``'s metadata failed the check
        before (not forgotten yet): then it is checked only with a spare started (:data:`ONLY_WITH_A_SPARE`)."""
        now = time.monotonic()
        if node_id in self._checking:
            raise ResourceExhausted(f"node {node_id!r} has a handshake whose agent metadata is being checked: one at a "
                                    "time per node; retry once that one has answered")
        entry = self._failures.get(node_id)
        if entry is not None and now < entry[1]:
            raise ResourceExhausted(f"node {node_id!r} handed over agent metadata that failed this node's check "
                                    f"({entry[0]} time(s) recently): its handshakes are refused for another "
                                    f"{entry[1] - now:.1f} s; retry after that")
        self._checking.add(node_id)
        return self._count(node_id, now) > 0

    def leave(self, node_id: str, failed: bool) -> None:
        """``node_id``'s check ended; ``failed``: its metadata failed the check (the cooldown starts now)."""
        self._checking.discard(node_id)
        now = time.monotonic()
        count = self._count(node_id, now)
        if not failed:
            if not count:
                self._failures.pop(node_id, None)
            return
        self._failures.pop(node_id, None)  # re-inserted last: the dict stays ordered by latest failure
        count = min(count + 1, 64)
        self._failures[node_id] = (count, now + min(self._first_s * 2 ** (count - 1), self._max_s), now)
        while len(self._failures) > self._max_nodes:
            del self._failures[next(iter(self._failures))]

    def cooling(self, node_id: str) -> float:
        """Seconds left of ``node_id``'s cooldown (0: none)."""
        entry = self._failures.get(node_id)
        return 0.0 if entry is None else max(0.0, entry[1] - time.monotonic())


def _child() -> None:
    answers = os.dup(1)
    os.dup2(2, 1)  # NIXL's and UCX's own output goes to stderr, never between the answers
    from nixl._api import nixl_agent, nixl_agent_config

    # no progress thread: this agent only loads metadata (a progress thread polls a core without pause)
    agent = nixl_agent(f"metadata-vetting-{uuid.uuid4().hex[:8]}",
                       nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    os.write(answers, READY)
    source = sys.stdin.buffer
    while len(header := source.read(_LENGTH.size)) == _LENGTH.size:
        metadata = source.read(_LENGTH.unpack(header)[0])
        try:
            name = agent.add_remote_agent(metadata)
            agent.remove_remote_agent(name)
        except Exception:  # noqa: BLE001 - NIXL raises its own classes; the parent replaces this child
            os.write(answers, REFUSED)
            return
        os.write(answers, LOADED)


if __name__ == "__main__":
    _child()
