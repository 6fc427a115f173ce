"""The metadata vetter's start is part of a node's readiness, and bounded: a vetter whose child has not started its
agent (here: stopped with SIGSTOP before it could) is reported not started within the bound asked, and started once
the child runs (a real child process with a NIXL agent). NixlTransport.ready() waits for it, so a node's health
(TRANSFERS_HEALTH) and every caller of ready() count the vetter's start, not the first pull's bound."""

from __future__ import annotations

import asyncio
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
