from __future__ import annotations

import pytest

from kvmesh.namespace import CacheConfig, Namespace
from tenancy.api_keys import new_key


@pytest.fixture
def ns() -> Namespace:
    return Namespace("acme", "tiny-llama", "v1", CacheConfig(block_size=32)).validate()


@pytest.fixture(scope="session")
def admin_key() -> str:
    return new_key()[1]


@pytest.fixture
def cp_config(redis_server, key_prefix, admin_key):
    from control_plane.config import ControlPlaneConfig

    return ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=key_prefix,
                              lease_ms=60_000, admin_key=admin_key, route_stats_refresh_ms=0,
                              route_speculative_ttl_ms=0)  # test_router.py covers speculative entries


@pytest.fixture
async def control_plane(cp_config):
    """A real control-plane gRPC server on a free loopback port."""
    from control_plane.server import serve

    running = await serve(cp_config)
    yield running
    await running.stop()


@pytest.fixture
async def cp_stub(control_plane, ns, admin_key):
    """A ControlPlane stub; the namespace's tenant exists (open to every node)."""
    import grpc

    from kvmesh.v1 import control_plane_pb2_grpc, tenant_admin_pb2, tenant_admin_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{control_plane.port}") as channel:
        admin = tenant_admin_pb2_grpc.TenantAdminStub(channel)
        await admin.CreateTenant(tenant_admin_pb2.CreateTenantRequest(tenant_id=ns.tenant),
                                 metadata=(("authorization", f"Bearer {admin_key}"),))
        yield control_plane_pb2_grpc.ControlPlaneStub(channel)


@pytest.fixture
async def scheduler(control_plane, cp_stub, ns, admin_key):
    from control_plane.scheduler_client import SchedulerClient

    async with SchedulerClient(f"127.0.0.1:{control_plane.port}", ns, api_key=admin_key) as client:
        yield client
