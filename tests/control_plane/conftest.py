from __future__ import annotations

import pytest

from kvmesh.namespace import CacheConfig, Namespace

from control_plane.redis_block_map import RedisBlockMap


@pytest.fixture
def ns() -> Namespace:
    return Namespace("acme", "tiny-llama", "v1", CacheConfig(block_size=32)).validate()


@pytest.fixture(params=["redis", "redis-cluster"])
def store_url(request) -> str:
    """Every block-map test runs against one Redis server and against a Redis Cluster."""
    fixture = "redis_server" if request.param == "redis" else "redis_cluster"
    return request.getfixturevalue(fixture).url


class ReplicaLookups(RedisBlockMap):
    """Answers every lookup from its in-memory replica (waits for the namespace to be in sync first), so the
    conformance suite runs against the replica as well as against lookup.lua."""

    async def lookup_prefix(self, ns, block_hashes, tiers):
        key = await self.blocks_key(ns)
        assert await self.replica.wait_synced(key, 10), "the replica did not load the namespace"
        if block_hashes:
            assert self.replica.lookup(key, block_hashes, tiers) is not None
        return await super().lookup_prefix(ns, block_hashes, tiers)


@pytest.fixture(params=["script", "replica"])
async def block_map(request, store_url, key_prefix):
    """Every block-map test runs with lookups by lookup.lua and with lookups from the in-memory replica."""
    if request.param == "script":
        bm = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    else:
        bm = ReplicaLookups(store_url, lease_ms=60_000, key_prefix=key_prefix, read_replica=True)
    yield bm
    await bm.close()


@pytest.fixture
def cp_config(redis_server, key_prefix, admin_key):
    from control_plane.config import ControlPlaneConfig

    return ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=key_prefix,
                              lease_ms=60_000, max_batch_blocks=1000, max_lookup_blocks=2048, admin_key=admin_key)


@pytest.fixture
async def control_plane(cp_config):
    """A real control-plane gRPC server on a free loopback port, with tenant "acme" created."""
    from control_plane.server import serve
    from tenancy.model import TenantPolicy

    running = await serve(cp_config)
    await running.core.tenants.create_tenant("acme", "Acme", TenantPolicy())
    yield running
    await running.stop()


@pytest.fixture
def admin():
    """The principal of the bootstrap admin key, for calling the core directly."""
    from tenancy.model import Principal, Role

    return Principal("bootstrap", Role.ADMIN)


@pytest.fixture
async def cp_stub(control_plane, admin_key):
    """A ControlPlane stub authenticated as the bootstrap admin."""
    from kvmesh.channels import channel
    from kvmesh.v1 import control_plane_pb2_grpc

    async with channel(f"127.0.0.1:{control_plane.port}", admin_key) as ch:
        yield control_plane_pb2_grpc.ControlPlaneStub(ch)
