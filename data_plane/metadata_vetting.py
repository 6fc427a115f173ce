"""A peer's NIXL agent metadata is loaded first by a throwaway agent in a child process.

The connection part of an agent's metadata is UCX's packed worker address, opaque to
:func:`data_plane.nixl_metadata.read_agent_metadata`. UCX aborts the whole process on some malformed
addresses: one flipped byte (the address's version) trips an assertion in its address unpacking
(``address.c: Assertion `*addr_version == UCP_OBJECT_VERSION_V2' failed``), so any grant holder could
kill a source with one handshake. A data plane therefore hands NIXL a peer's metadata only after
:class:`MetadataVetter`'s child loaded (and unloaded) it in an agent of its own: when the child dies doing
so, the metadata is refused and only the child is lost; the next handshake gets a new one. A child that NIXL
refused is replaced too (NIXL may keep a half-loaded agent name, which would refuse the real metadata later).

Protocol on the child's stdin/stdout (stdout is the child's fd 1 before it points fd 1 at stderr, so
NIXL's and UCX's own output never mixes in): the child writes ``R`` once its agent exists; then for each
``<u32 length><metadata>`` it reads, it writes ``1`` (loaded) or ``0`` (NIXL refused it).
"""

from __future__ import annotations

import asyncio
import os
import select
import struct
import subprocess
import sys
import threading
import time
import uuid

from kvmesh.errors import InvalidArgument, Unavailable

_LENGTH = struct.Struct("<I")
READY, LOADED, REFUSED = b"R", b"1", b"0"


def _ready_by(fd: int, event: int, deadline: float) -> bool:
    """Whether ``fd`` is ready for ``event`` (POLLIN, POLLOUT) before ``deadline`` (poll, not select: a busy data
    plane's descriptors pass 1,023, where select() raises)."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))


class MetadataVetter:
    """The parent's side: a child with a NIXL agent, started at once (it takes seconds), replaced after each
    refusal or death. One metadata at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ready = False
        self.deaths = 0  # children that died loading a metadata (each one refused)
        self._start()

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "data_plane.metadata_vetting"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, bufsize=0)
        self._ready = False

    def _replace(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._start()

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
        (blocking: run it in a thread)."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            raise Unavailable("this node could not check the agent metadata in time (other handshakes' checks "
                              "held its checking process); try the handshake again")
        try:
            if self._proc.poll() is not None:
                self._start()
            answer = b""
            try:
                if not self._ready:
                    answer = self._answer(deadline)
                    self._ready = answer == READY
                if self._ready:
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
            raise Unavailable("this node could not check the agent metadata in time (its checking process is "
                              "still starting or stuck); try the handshake again")
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
                self._start()
            if not self._ready:
                try:
                    self._ready = self._answer(deadline) == READY
                except OSError:
                    self._ready = False
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
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()  # the child ends on end of input
            try:
                self._proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


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
