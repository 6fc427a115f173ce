"""Tenant administration: roles on every RPC, keys that stop working at once, rotation, audit, the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest

from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, tenant_admin_pb2 as tpb


async def expect(coro, code, text=""):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details()


def ns_pb(tenant):
    return common_pb2.Namespace(tenant=tenant, model="m", weight_version="v1",
                                cache_config=common_pb2.CacheConfig(block_size=32))


async def test_every_rpc_needs_credentials(fleet):
    anonymous = fleet.cp(None)
    await expect(anonymous.Ping(common_pb2.PingRequest()), grpc.StatusCode.UNAUTHENTICATED, "missing credentials")
    await expect(fleet.tenant_admin(None).ListTenants(tpb.ListTenantsRequest()), grpc.StatusCode.UNAUTHENTICATED)
    await expect(fleet.cp("kvm_000000000000_nope").Ping(common_pb2.PingRequest()), grpc.StatusCode.UNAUTHENTICATED,
                 "invalid API key")
    await expect(fleet.cp("Basic abc").Ping(common_pb2.PingRequest()), grpc.StatusCode.UNAUTHENTICATED, "malformed")


async def test_roles_are_enforced(fleet):
    await fleet.tenant("tenant-a")
    _, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    _, node = await fleet.key("node", node_id="node-1", pool="east")
    await expect(fleet.tenant_admin(sched).ListTenants(tpb.ListTenantsRequest()), grpc.StatusCode.PERMISSION_DENIED,
                 "needs the admin role")
    await expect(fleet.tenant_admin(node).CreateTenant(tpb.CreateTenantRequest(tenant_id="evil")),
                 grpc.StatusCode.PERMISSION_DENIED)
    info = pb.NodeInfo(node_id="node-1", data_plane_address="127.0.0.1:1", pool="east")
    await expect(fleet.cp(sched).RegisterNode(pb.RegisterNodeRequest(node=info)), grpc.StatusCode.PERMISSION_DENIED,
                 "needs that node's key")
    await expect(fleet.cp(node).RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(
        node_id="node-2", data_plane_address="127.0.0.1:1"))), grpc.StatusCode.PERMISSION_DENIED)
    await expect(fleet.cp(node).RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(
        node_id="node-1", data_plane_address="127.0.0.1:1", pool="west"))), grpc.StatusCode.PERMISSION_DENIED,
        "belongs to pool 'east'")
    assert (await fleet.cp(node).RegisterNode(pb.RegisterNodeRequest(node=info))).incarnation >= 1
    await expect(fleet.cp(sched).ReportStats(pb.ReportStatsRequest()), grpc.StatusCode.PERMISSION_DENIED)


async def test_a_revoked_key_stops_working_at_once_and_rotation_replaces_it(fleet):
    await fleet.tenant("tenant-a")
    key_id, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    as_sched = fleet.cp(sched)
    await as_sched.Ping(common_pb2.PingRequest())
    rotated = await fleet.admin.RotateKey(tpb.RotateKeyRequest(key_id=key_id))
    await expect(as_sched.Ping(common_pb2.PingRequest()), grpc.StatusCode.UNAUTHENTICATED, "revoked")
    await fleet.cp(rotated.secret).Ping(common_pb2.PingRequest())
    assert rotated.key.role == tpb.ROLE_SCHEDULER and rotated.key.tenant_id == "tenant-a"
    await fleet.admin.RevokeKey(tpb.RevokeKeyRequest(key_id=rotated.key.key_id))
    await expect(fleet.cp(rotated.secret).Ping(common_pb2.PingRequest()), grpc.StatusCode.UNAUTHENTICATED, "revoked")
    keys = (await fleet.admin.ListKeys(tpb.ListKeysRequest(tenant_id="tenant-a"))).keys
    assert {k.key_id: k.revoked for k in keys} == {key_id: True, rotated.key.key_id: True}


async def test_bad_admin_requests(fleet):
    await fleet.tenant("tenant-a")
    await expect(fleet.tenant("tenant-a"), grpc.StatusCode.ALREADY_EXISTS, "exists")
    await expect(fleet.tenant("Bad Name"), grpc.StatusCode.INVALID_ARGUMENT, "not a valid tenant id")
    await expect(fleet.tenant("t2", shared_with=["NOPE!"]), grpc.StatusCode.INVALID_ARGUMENT)
    await expect(fleet.admin.GetTenant(tpb.GetTenantRequest(tenant_id="ghost")), grpc.StatusCode.NOT_FOUND)
    await expect(fleet.key("scheduler"), grpc.StatusCode.INVALID_ARGUMENT, "needs a tenant_id")
    await expect(fleet.key("scheduler", tenant_id="ghost"), grpc.StatusCode.NOT_FOUND)
    await expect(fleet.key("node"), grpc.StatusCode.INVALID_ARGUMENT, "needs a node_id")
    await expect(fleet.key("admin", tenant_id="tenant-a"), grpc.StatusCode.INVALID_ARGUMENT, "not bound to a tenant")
    await expect(fleet.admin.IssueKey(tpb.IssueKeyRequest(role=0)), grpc.StatusCode.INVALID_ARGUMENT, "role must be")
    await expect(fleet.admin.RevokeKey(tpb.RevokeKeyRequest(key_id="nope")), grpc.StatusCode.NOT_FOUND)


async def test_admin_actions_and_denials_are_audited(fleet):
    await fleet.tenant("tenant-a")
    _, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    with pytest.raises(grpc.aio.AioRpcError):
        await fleet.tenant_admin(sched).DeleteTenant(tpb.DeleteTenantRequest(tenant_id="tenant-a"))
    with pytest.raises(grpc.aio.AioRpcError):
        await fleet.cp(None).Ping(common_pb2.PingRequest())
    entries = (await fleet.admin.ListAudit(tpb.ListAuditRequest(limit=50))).entries
    seen = {(e.action, e.outcome) for e in entries}
    assert ("CreateTenant", "ok") in seen and ("IssueKey", "ok") in seen
    assert ("denied:DeleteTenant", "PERMISSION_DENIED") in seen
    assert ("denied:Ping", "UNAUTHENTICATED") in seen


async def test_deleting_a_tenant_revokes_its_keys_and_drops_its_blocks(fleet, control_plane):
    await fleet.tenant("tenant-a")
    _, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    _, node = await fleet.key("node", node_id="node-1")
    cp = fleet.cp(node)
    reg = await cp.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(node_id="node-1",
                                                                        data_plane_address="127.0.0.1:1")))
    await cp.PublishEvents(pb.EventBatch(node_id="node-1", incarnation=reg.incarnation, seq=1,
                                         namespace=ns_pb("tenant-a"), events=[pb.KvEvent(stored=pb.BlockStored(
                                             block_hashes=[b"x" * 32], block_size=32,
                                             medium=common_pb2.MEDIUM_CPU))]))
    assert await control_plane.core.tenants.index_entries("tenant-a") == 1
    await fleet.admin.DeleteTenant(tpb.DeleteTenantRequest(tenant_id="tenant-a"))
    await expect(fleet.cp(sched).Ping(common_pb2.PingRequest()), grpc.StatusCode.UNAUTHENTICATED, "revoked")
    assert await control_plane.core.tenants.index_entries("tenant-a") == 0


async def test_redis_credentials_rotate_without_interruption(fleet, control_plane):
    await fleet.tenant("tenant-a")
    lookup = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), block_hashes=[b"y" * 32])
    await fleet.admin_cp.LookupPrefix(lookup)  # opens a connection as the tenant's Redis user
    before = await control_plane.core.tenants.redis_credentials("tenant-a")
    await fleet.admin.RotateRedisCredentials(tpb.RotateRedisCredentialsRequest(tenant_id="tenant-a"))
    assert await control_plane.core.tenants.redis_credentials("tenant-a") != before
    control_plane.core.block_map.forget_tenant("tenant-a")  # a new connection must use the new password
    await fleet.admin_cp.LookupPrefix(lookup)


async def test_admin_cli(control_plane, admin_key):
    base = [sys.executable, "-m", "kvmesh_apps.cli", "admin", "--control-plane", f"127.0.0.1:{control_plane.port}",
            "--key", admin_key]

    async def run(*args):  # a child process, while this event loop keeps serving the control plane
        proc = await asyncio.create_subprocess_exec(*base, *args, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, out.decode(), err.decode()

    rc, out, _ = await run("tenants", "create", "cli-tenant", "--name", "CLI", "--max-index-entries", "100",
                           "--max-namespaces", "12")
    assert rc == 0 and json.loads(out)["policy"]["max_index_entries"] == "100"
    assert json.loads(out)["policy"]["max_namespaces"] == "12"
    rc, out, _ = await run("keys", "issue", "--role", "scheduler", "--tenant", "cli-tenant")
    assert rc == 0 and json.loads(out)["secret"].startswith("kvm_")
    rc, _, err = await run("tenants", "get", "ghost")
    assert rc == 1 and "NOT_FOUND" in err
    new = subprocess.run([sys.executable, "-m", "kvmesh_apps.cli", "admin", "new-key"], capture_output=True, text=True)
    assert new.stdout.startswith("kvm_")
