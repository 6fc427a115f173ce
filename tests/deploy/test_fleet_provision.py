"""The local fleet's provisioning (tenant and node keys through the admin API) rides out a Redis that stalls past
the control plane's socket timeout, as an ACL SAVE's fsync does on a machine busy starting engines (CI saw `kvmesh
up` fail with "block map store unavailable: Timeout reading from ..."), for at most ``PROVISION_RETRY_S``.
Real processes: Valkey, the control plane, one data plane; the stall is a SIGSTOP of Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest

from kvmesh_apps import fleet as fleet_module
from kvmesh_apps.fleet import Fleet
from tenancy import api_keys

pytestmark = [pytest.mark.nixl]

STALL_S = 3.0  # longer than the control plane's Redis socket timeout (kvmesh.redis_client.SOCKET_TIMEOUT_S)


@pytest.fixture
def fleet(tmp_path, admin_key):
    started = Fleet(tmp_path, 1, admin_key, tls=False).start()
    yield started
    os.kill(started.redis.proc.pid, signal.SIGCONT)
    started.stop()


def _provision_during_stall(fleet: Fleet, node: str) -> tuple[object, float]:
    """Provisions ``node`` while Redis is stopped for STALL_S; (its key or the error raised, seconds taken)."""
    out: list[object] = []
    os.kill(fleet.redis.proc.pid, signal.SIGSTOP)
    started = time.monotonic()

    def provision() -> None:
        try:
            out.append(asyncio.run(fleet._provision([node]))[node])
        except grpc.aio.AioRpcError as exc:
            out.append(exc)

    thread = threading.Thread(target=provision)
    thread.start()
    time.sleep(STALL_S)
    os.kill(fleet.redis.proc.pid, signal.SIGCONT)
    thread.join(60)
    assert not thread.is_alive(), "provisioning hung"
    return out[0], time.monotonic() - started


def test_provisioning_rides_out_a_redis_stall(fleet):
    key, took = _provision_during_stall(fleet, "dp9")
    assert isinstance(key, str) and api_keys.parse(key), key
    assert took >= STALL_S


def test_without_the_retry_the_same_stall_fails_provisioning(fleet, monkeypatch):
    """Negative control: the stall does make the control plane answer UNAVAILABLE."""
    monkeypatch.setattr(fleet_module, "PROVISION_RETRY_S", 0.0)
    error, _ = _provision_during_stall(fleet, "dp9")
    assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE, error
