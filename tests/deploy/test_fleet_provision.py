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

from kvmesh.channels import channel
from kvmesh.v1 import tenant_admin_pb2 as ta_pb, tenant_admin_pb2_grpc as ta_grpc
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


async def _live_node_keys(fleet: Fleet, node: str) -> dict[str, str]:
    """key id -> description of the node's unrevoked keys, as the admin API lists them."""
    async with channel(fleet.control_plane.address, fleet.admin_key, fleet.client_tls()) as ch:
        keys = (await ta_grpc.TenantAdminStub(ch).ListKeys(ta_pb.ListKeysRequest())).keys
    return {k.key_id: k.description for k in keys if k.node_id == node and not k.revoked}


async def _operator_key(fleet: Fleet, node: str) -> str:
    async with channel(fleet.control_plane.address, fleet.admin_key, fleet.client_tls()) as ch:
        reply = await ta_grpc.TenantAdminStub(ch).IssueKey(ta_pb.IssueKeyRequest(
            role=ta_pb.ROLE_NODE, node_id=node, description="an operator's own key"))
    return reply.key.key_id


def test_a_key_nobody_holds_is_revoked_when_the_node_is_provisioned_again(fleet):
    """A provisioning whose IssueKey answer was lost (a stalled Redis timed out after storing it) leaves a key no
    file holds; the next provisioning of that node revokes it. An operator's own key for the node (the control:
    same node, another description) stays live, and so does the key the fleet handed out last."""
    orphan = api_keys.parse(asyncio.run(fleet._provision(["dp9"]))["dp9"])[0]  # answer never written anywhere
    operator = asyncio.run(_operator_key(fleet, "dp9"))
    assert set(asyncio.run(_live_node_keys(fleet, "dp9"))) == {orphan, operator}  # positive control: both live

    held = api_keys.parse(asyncio.run(fleet._provision(["dp9"]))["dp9"])[0]

    assert set(asyncio.run(_live_node_keys(fleet, "dp9"))) == {held, operator}
    assert held != orphan


def test_the_key_in_the_nodes_file_is_kept_not_revoked(fleet):
    """A restart's provisioning reuses the key the node's file holds and revokes nothing."""
    before = asyncio.run(_live_node_keys(fleet, "dp1"))
    assert len(before) == 1
    kept = asyncio.run(fleet._provision(["dp1"]))["dp1"]
    assert api_keys.parse(kept)[0] in before
    assert asyncio.run(_live_node_keys(fleet, "dp1")) == before
