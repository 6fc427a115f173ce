"""Tier changes reach a real control plane, and pulls run on its grants: commits, evictions and pulls
show up in LookupPrefix; the consumer data plane fetches its pull grant from the control plane."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvmesh.channels import channel
from kvmesh.v1 import common_pb2, control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from tenancy.model import Role, TenantPolicy

from control_plane.config import ControlPlaneConfig
from control_plane.server import serve as serve_control_plane

from data_plane.client import DataPlaneClient, SharedTier


@pytest.fixture
async def control_plane(redis_server, key_prefix, admin_key, ns):
    running = await serve_control_plane(ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url,
                                                           key_prefix=key_prefix, admin_key=admin_key))
    await running.core.tenants.create_tenant(ns.tenant, "", TenantPolicy(allowed_nodes=("cp-a", "cp-b")))
    yield running
    await running.stop()


async def nixl_up(*nodes) -> None:
    """Waits for the nodes' NIXL agents (and metadata vetters): a pull before then answers MISS by design, and
    on a loaded machine they take more than a pull's 10 s bound to start (this file is about the events)."""
    for node in nodes:
        await node.core.transport.ready(120.0)


async def holders(address: str, key: str, ns, hashes: list[bytes]) -> dict[str, int]:
    async with channel(address, key) as ch:
        r = await cp_grpc.ControlPlaneStub(ch).LookupPrefix(
            cp_pb.LookupPrefixRequest(namespace=ns.to_proto(), block_hashes=hashes,
                                      media=[common_pb2.MEDIUM_CPU]))
    return {h.node_id: h.leading_blocks for h in r.holders}


async def test_commit_pull_and_eviction_are_published(control_plane, local_node, ns, block_bytes, admin_key):
    cp = f"127.0.0.1:{control_plane.port}"
    keys = {n: (await control_plane.core.tenants.issue_key(Role.NODE, node_id=n))[1] for n in ("cp-a", "cp-b", "cp-x")}
    # 6 slots: a peer pulls 3 (one peer pins at most half a node's slots), and 4 more evict one of them
    node = dict(control_plane_address=cp, capacity_bytes=6 * block_bytes, grant_public_key="")
    a = await local_node(node_id="cp-a", api_key=keys["cp-a"], **node)
    b = await local_node(node_id="cp-b", api_key=keys["cp-b"], **node)
    x = await local_node(node_id="cp-x", api_key=keys["cp-x"], **node)  # outside the tenant's policy
    await nixl_up(a, b, x)
    hashes = [os.urandom(32) for _ in range(3)]
    async with DataPlaneClient(a.address, key=keys["cp-a"]) as ca, DataPlaneClient(b.address, key=keys["cp-b"]) as cb, \
            DataPlaneClient(x.address, key=keys["cp-x"]) as cx:
        tier = SharedTier.open(await ca.describe_tier())
        for slot in await ca.reserve(ns, hashes):
            tier.slot(slot)[:] = np.uint8(slot)
        tier.close()
        await ca.commit(ns, hashes)
        assert (await cb.pull(ns, hashes, "cp-a", a.address)).pulled == 3  # grant fetched from the control plane
        assert (await cx.pull(ns, hashes, "cp-a", a.address)).pulled == 0  # no grant for cp-x: MISS, no error
        assert await a.publisher.flush(5.0) and await b.publisher.flush(5.0)
        assert await holders(cp, admin_key, ns, hashes) == {"cp-a": 3, "cp-b": 3}
        await ca.reserve(ns, [os.urandom(32) for _ in range(4)])  # evicts hashes[0] (LRU) on a
        assert await a.publisher.flush(5.0)
        assert await holders(cp, admin_key, ns, hashes) == {"cp-b": 3}
        snapshot = list(a.core.snapshot())
        assert [(m, len(h)) for _, m, h in snapshot] == [(common_pb2.MEDIUM_CPU, 2)]


async def test_tenant_cpu_tier_quota_and_node_policy_hold_on_the_node(control_plane, local_node, ns, block_bytes):
    import grpc

    await control_plane.core.tenants.set_policy(ns.tenant, TenantPolicy(
        allowed_nodes=("cp-a", "cp-b"), max_cpu_tier_bytes_per_node=2 * block_bytes))
    cp = f"127.0.0.1:{control_plane.port}"
    keys = {n: (await control_plane.core.tenants.issue_key(Role.NODE, node_id=n))[1] for n in ("cp-a", "cp-b", "cp-x")}
    node = dict(control_plane_address=cp, capacity_bytes=8 * block_bytes, grant_public_key="")
    a = await local_node(node_id="cp-a", api_key=keys["cp-a"], **node)
    b = await local_node(node_id="cp-b", api_key=keys["cp-b"], **node)
    x = await local_node(node_id="cp-x", api_key=keys["cp-x"], **node)
    await nixl_up(a, b, x)
    hashes = [os.urandom(32) for _ in range(3)]
    async with DataPlaneClient(a.address, key=keys["cp-a"]) as ca, DataPlaneClient(b.address, key=keys["cp-b"]) as cb, \
            DataPlaneClient(x.address, key=keys["cp-x"]) as cx:
        assert -1 not in await ca.reserve(ns, hashes[:2])
        await ca.commit(ns, hashes[:2])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ca.reserve(ns, hashes[2:])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "nothing was reserved" in err.value.details()
        slots, lease = await ca.acquire(ns, hashes[:2])  # nothing already stored was lost
        assert len(slots) == 2
        await ca.release(lease)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # cp-x is outside the tenant's policy
            await cx.reserve(ns, hashes)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        await cb.reserve(ns, hashes[2:])  # the quota is per node: cp-b holds one, may pull one more
        await cb.commit(ns, hashes[2:])
        result = await cb.pull(ns, hashes[:2], "cp-a", a.address)
        assert result.pulled == 1  # the second would pass the limit: MISS, not an error
