"""A deleted and re-created tenant does not inherit its predecessor's blocks (issue 9, hardening).

Tenant T stores blocks on node A; an admin deletes T and creates T again (same id, a new epoch). The new T's
grant-based pull from A and its engine's local Acquire on A must MISS: a fresh grant carries the new epoch, so the
grant path misses at once; A learns the epoch from GetTenantLimits within its refresh period and then drops T's
old blocks from its tiers (the local path). Positive controls: before the deletion the same lookup, pull and
acquire HIT. Real Redis and control plane (in this process), real data-plane processes (gRPC, NIXL).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvmesh.channels import channel
from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from kvmesh.v1 import tenant_admin_pb2 as tpb, tenant_admin_pb2_grpc as tpb_grpc
from tenancy.peer_proof import NodeIdentity

from data_plane.client import DataPlaneClient
from data_plane.types import LookupStatus
from kvmesh_apps.dp_process import DataPlaneProcess

from tests.security.test_node_key_peer_calls import BLOCK, NS, store, world  # noqa: F401 - world: a fixture

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

N = 2
REFRESH_MS = 500
BOUND_S = REFRESH_MS / 1000 + 2.0 + 5.0  # a refresh period, one control-plane call (timeout), a loaded host


async def recreate(world) -> None:
    """What an admin does: delete the tenant, create it again under the same id and policy."""
    async with channel(world.address, world.admin_key) as ch:
        admin = tpb_grpc.TenantAdminStub(ch)
        await admin.DeleteTenant(tpb.DeleteTenantRequest(tenant_id=NS.tenant))
        await admin.CreateTenant(tpb.CreateTenantRequest(tenant_id=NS.tenant, policy=POLICY))


POLICY = tpb.TenantPolicy(max_cpu_tier_bytes_per_node=N * BLOCK)


async def limit_tenant(world) -> None:
    async with channel(world.address, world.admin_key) as ch:
        await tpb_grpc.TenantAdminStub(ch).SetPolicy(tpb.SetPolicyRequest(tenant_id=NS.tenant, policy=POLICY))


async def granted_lookup(world, me: NodeIdentity, source: DataPlaneProcess, hashes: list[bytes]) -> list:
    """A peer's Lookup on ``source`` with a grant the control plane issues now (the attacker's pull)."""
    grant = await world.grant(await world.node_key("consumer"), source.node_id, me.public_key)
    async with DataPlaneClient(source.address, peer_proof=lambda g, m: me.proof(g, m, source.node_id)) as peer:
        answer, _ = await peer.lookup(NS, hashes, grant=grant)
        if answer.lease_id:
            await peer.release(answer.lease_id, grant=grant)
    return answer.statuses


async def acquired(node: DataPlaneProcess, hashes: list[bytes]) -> int:
    """How many leading blocks the node's own engine gets from a local Acquire."""
    async with DataPlaneClient(node.address, key=node.api_key) as local:
        slots, lease = await local.acquire(NS, hashes)
        if lease:
            await local.release(lease)
    return len(slots)


async def eventually(probe, expected, bound_s: float = BOUND_S) -> bool:
    deadline = time.monotonic() + bound_s
    while await probe() != expected:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def test_a_node_learns_the_epoch_and_of_the_deletion(world):
    async def limits(key: str):
        async with channel(world.address, key) as ch:
            return await cp_grpc.ControlPlaneStub(ch).GetTenantLimits(cp_pb.GetTenantLimitsRequest(tenant=NS.tenant))

    node_key = await world.node_key("dp-src")
    first = (await limits(node_key)).tenant_epoch
    assert first
    async with channel(world.address, world.admin_key) as ch:
        await tpb_grpc.TenantAdminStub(ch).DeleteTenant(tpb.DeleteTenantRequest(tenant_id=NS.tenant))
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await limits(node_key)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    async with channel(world.address, world.admin_key) as ch:
        await tpb_grpc.TenantAdminStub(ch).CreateTenant(tpb.CreateTenantRequest(tenant_id=NS.tenant))
    assert (await limits(node_key)).tenant_epoch not in ("", first)


async def test_a_fresh_grant_of_the_new_tenant_misses_at_once(world):
    # The source never refreshes during the test: only the grant's epoch stops the pull.
    source = await world.data_plane("dp-src", KVMESH_DP_CONTROL_PLANE_REFRESH_MS="600000")
    me = NodeIdentity()  # this process plays the new tenant's consumer (a real node key, a real grant)
    hashes = await store(source, N)
    assert await granted_lookup(world, me, source, hashes) == [LookupStatus.HIT] * N  # positive control

    await recreate(world)

    assert await granted_lookup(world, me, source, hashes) == [LookupStatus.MISS] * N


async def test_the_new_tenant_gets_nothing_of_the_old_one_and_the_tiers_let_go(world):
    await limit_tenant(world)
    source = await world.data_plane("dp-src", KVMESH_DP_CONTROL_PLANE_REFRESH_MS=str(REFRESH_MS))
    consumer = await world.data_plane("consumer", KVMESH_DP_CONTROL_PLANE_REFRESH_MS=str(REFRESH_MS))
    me = NodeIdentity()
    hashes = await store(source, N)
    async with DataPlaneClient(source.address, key=source.api_key) as on_source, \
            DataPlaneClient(consumer.address, key=consumer.api_key) as on_consumer:
        # Positive controls: the old tenant's bytes are there for a granted pull, a real pull and the engine.
        assert await granted_lookup(world, me, source, hashes) == [LookupStatus.HIT] * N
        assert (await on_consumer.pull(NS, hashes, "dp-src", source.address)).pulled == N
        assert await acquired(source, hashes) == N and await acquired(consumer, hashes) == N
        # The tenant's CPU-tier limit counts what the source holds for it: full now.
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await on_source.reserve(NS, [b"\x01" * 32])
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        await recreate(world)

        assert await granted_lookup(world, me, source, hashes) == [LookupStatus.MISS] * N  # at once
        # Within a refresh period both nodes learn the new epoch and drop the old blocks.
        assert await eventually(lambda: acquired(source, hashes), 0)
        assert await eventually(lambda: acquired(consumer, hashes), 0)
        assert (await on_consumer.pull(NS, hashes, "dp-src", source.address)).pulled == 0
        # The source's tier no longer holds them: the new tenant has its whole limit again (within a refresh
        # period: a refresh between the deletion and the creation leaves the source knowing the tenant as
        # deleted until its next one, and a Reserve meanwhile is PERMISSION_DENIED; old blocks still held
        # past the bound would keep it RESOURCE_EXHAUSTED).
        fresh = [bytes([i]) * 32 for i in range(1, N + 1)]

        async def reserved_all() -> bool:
            try:
                slots = await on_source.reserve(NS, fresh)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise
                return False
            await on_source.abort(NS, fresh)
            return all(slot >= 0 for slot in slots)

        assert await eventually(reserved_all, True)


async def test_a_node_the_tenant_stops_allowing_drops_its_blocks_and_cannot_tell_that_from_no_tenant(world):
    """A node key asked GetTenantLimits and learnt whether any tenant id exists (NOT_FOUND) or exists without
    allowing it (PERMISSION_DENIED); and a node the tenant's policy stopped allowing kept serving the tenant's blocks
    to its engines. Now both answers are NOT_FOUND in the same words, and the node drops the tenant's blocks."""
    async def limits(key: str, tenant: str) -> tuple[str, str]:
        async with channel(world.address, key) as ch:
            try:
                reply = await cp_grpc.ControlPlaneStub(ch).GetTenantLimits(cp_pb.GetTenantLimitsRequest(tenant=tenant))
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, (exc.details() or "").replace(repr(tenant), "<tenant>")
            return "OK", reply.tenant_epoch

    source = await world.data_plane("dp-src", KVMESH_DP_CONTROL_PLANE_REFRESH_MS=str(REFRESH_MS))
    hashes = await store(source, N)
    node_key = await world.node_key("dp-src")
    # Positive controls: the tenant answers this node with its epoch, the node's engine gets the blocks.
    code, epoch = await limits(node_key, NS.tenant)
    assert code == "OK" and epoch
    assert await acquired(source, hashes) == N

    async with channel(world.address, world.admin_key) as ch:
        await tpb_grpc.TenantAdminStub(ch).SetPolicy(tpb.SetPolicyRequest(
            tenant_id=NS.tenant, policy=tpb.TenantPolicy(allowed_nodes=["another-node"])))

    assert await limits(node_key, NS.tenant) == await limits(node_key, "no-such-tenant")
    assert (await limits(node_key, NS.tenant))[0] == "NOT_FOUND"
    assert await limits(world.admin_key, "no-such-tenant") == ("NOT_FOUND", "tenant <tenant> does not exist")
    assert (await limits(world.admin_key, NS.tenant))[0] == "OK"  # an admin still sees the tenant
    assert await eventually(lambda: acquired(source, hashes), 0)
    async with DataPlaneClient(source.address, key=source.api_key) as on_source:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await on_source.reserve(NS, [b"\x02" * 32])
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "does not exist or does not allow node 'dp-src'" in (refused.value.details() or "")

        # Allowed again: the node stores for the tenant again (nothing stuck), under the same epoch.
        async with channel(world.address, world.admin_key) as ch:
            await tpb_grpc.TenantAdminStub(ch).SetPolicy(tpb.SetPolicyRequest(tenant_id=NS.tenant,
                                                                              policy=tpb.TenantPolicy()))
        assert await limits(node_key, NS.tenant) == ("OK", epoch)
        assert await eventually(lambda: reserved(on_source, b"\x03" * 32), True)


async def reserved(client: DataPlaneClient, block_hash: bytes) -> bool:
    try:
        slots = await client.reserve(NS, [block_hash])
    except grpc.aio.AioRpcError:
        return False
    await client.abort(NS, [block_hash])
    return all(slot >= 0 for slot in slots)
