"""The metadata vetter's start is part of a node's readiness, and bounded: a vetter whose child has not started its
agent (here: stopped with SIGSTOP before it could) is reported not started within the bound asked, and started once
the child runs (a real child process with a NIXL agent). NixlTransport.ready() waits for it, so a node's health
(TRANSFERS_HEALTH) and every caller of ready() count the vetter's start, not the first pull's bound."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from kvmesh.errors import Unavailable

from data_plane.metadata_vetting import MetadataVetter
from data_plane.shm import SharedRegion
from data_plane.transfer import NixlTransport

pytestmark = [pytest.mark.nixl]


def test_a_vetter_that_has_not_started_is_not_ready_within_the_bound_and_is_once_it_runs():
    vetter = MetadataVetter()
    try:
        os.kill(vetter._proc.pid, signal.SIGSTOP)  # before its agent exists (importing NIXL takes seconds)
        started = time.monotonic()
        assert not vetter.wait_started(1.0)
        assert time.monotonic() - started < 3.0
        os.kill(vetter._proc.pid, signal.SIGCONT)
        assert vetter.wait_started(120.0)  # control: the same vetter, running, is ready
    finally:
        os.kill(vetter._proc.pid, signal.SIGCONT)
        vetter.close()


async def test_a_nodes_transport_is_not_ready_until_its_vetter_has_started(shm_dir):
    """NixlTransport.ready() (what TRANSFERS_HEALTH and every handshake wait for) counts the vetter: with its child
    stopped before its agent exists, ready() answers Unavailable within the bound; once it runs, ready()."""
    region = SharedRegion(shm_dir / "vetting.tier", 4096, 4, owner=True)
    transport = NixlTransport("vetting-node", region)
    try:
        os.kill(transport._vetter._proc.pid, signal.SIGSTOP)
        await asyncio.wait_for(asyncio.wrap_future(transport._built), 120.0)  # the node's own agent is up
        started = time.monotonic()
        with pytest.raises(Unavailable, match="agent metadata is still starting"):
            await transport.ready(1.0)
        assert time.monotonic() - started < 3.0
        os.kill(transport._vetter._proc.pid, signal.SIGCONT)
        await transport.ready(120.0)  # control: the same node, its vetter running
    finally:
        os.kill(transport._vetter._proc.pid, signal.SIGCONT)
        transport.close()
        region.close()


def test_a_stopped_vetter_bounds_every_check_a_large_metadata_and_those_queued_behind_it():
    """Found in review: the metadata went down the child's pipe in one blocking write under the vetter's lock, and
    the lock was taken without a bound: with the child stopped, a grant holder's metadata larger than the pipe's
    buffer (64 KiB) blocked that handshake's thread for good, and every later handshake's check behind it. Each
    now answers Unavailable within its own bound. Control: the replaced child answers again (NIXL refuses
    metadata that is not an agent's)."""
    import threading

    from kvmesh.errors import InvalidArgument

    vetter = MetadataVetter()
    try:
        assert vetter.wait_started(120.0)
        os.kill(vetter._proc.pid, signal.SIGSTOP)
        outcomes: dict[str, tuple[type, float]] = {}

        def vet(name: str, metadata: bytes, timeout_s: float) -> None:
            started = time.monotonic()
            try:
                vetter.vet(metadata, timeout_s)
                outcomes[name] = (type(None), time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - recorded for the asserts
                outcomes[name] = (type(exc), time.monotonic() - started)

        large = threading.Thread(target=vet, args=("large", bytes(1 << 20), 2.0), daemon=True)
        large.start()
        time.sleep(0.3)  # it holds the checking process
        behind = threading.Thread(target=vet, args=("behind", b"x" * 100, 0.5), daemon=True)
        behind.start()
        for thread in (large, behind):
            thread.join(10.0)
        assert outcomes.get("behind", (None, 0))[0] is Unavailable and outcomes["behind"][1] < 2.0, outcomes
        large_outcome = outcomes.get("large", (type(None), 0))
        assert issubclass(large_outcome[0], Unavailable) and large_outcome[1] < 4.0, outcomes
        with pytest.raises(InvalidArgument, match="NIXL cannot load it"):
            vetter.vet(b"not an agent's metadata", 60.0)
    finally:
        os.kill(vetter._proc.pid, signal.SIGCONT)
        vetter.close()


def test_a_check_that_times_out_on_a_starting_vetter_leaves_it_to_start():
    """Found in review: a check that timed out before the child had started killed it and started another, so under
    a steady stream of handshakes the vetter could never finish starting. The child is replaced only once it was
    sent something (or died). Control: the same child, let run, checks."""
    from kvmesh.errors import InvalidArgument

    vetter = MetadataVetter()
    try:
        pid = vetter._proc.pid
        os.kill(pid, signal.SIGSTOP)  # before its agent exists
        with pytest.raises(Unavailable, match="still starting or stuck"):
            vetter.vet(b"x" * 100, 0.5)
        assert vetter._proc.pid == pid, "a check that timed out replaced the starting child"
        os.kill(pid, signal.SIGCONT)
        with pytest.raises(InvalidArgument, match="NIXL cannot load it"):
            vetter.vet(b"not an agent's metadata", 120.0)
        assert vetter._proc.pid != pid  # a refusal replaces it, as before
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        vetter.close()


def test_the_vetter_works_with_descriptors_past_1023():
    """Found in review: the child's pipes were waited on with select(), which raises ValueError for a descriptor
    past 1023: a data plane with more than ~1,000 open sockets (its limit is raised to fit its connections) failed
    every handshake once its child was started there. Control: the check answers (NIXL refuses the bytes)."""
    import resource

    from kvmesh.errors import InvalidArgument

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the open-file limit ({hard}) leaves no descriptor past 1023")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    vetter = None
    try:
        vetter = MetadataVetter()
        assert vetter._proc.stdout.fileno() > 1023
        with pytest.raises(InvalidArgument, match="NIXL cannot load it"):
            vetter.vet(b"not an agent's metadata", 120.0)
    finally:
        if vetter is not None:
            vetter.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
