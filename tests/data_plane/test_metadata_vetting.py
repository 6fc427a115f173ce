"""The metadata vetter's start is part of a node's readiness, and bounded: a vetter whose child has not started its
agent (here: stopped with SIGSTOP before it could) is reported not started within the bound asked, and started once
the child runs (a real child process with a NIXL agent). NixlTransport.ready() waits for it, so a node's health
(TRANSFERS_HEALTH) and every caller of ready() count the vetter's start, not the first pull's bound."""

from __future__ import annotations

import os
import signal
import time

import pytest

from data_plane.metadata_vetting import MetadataVetter

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
