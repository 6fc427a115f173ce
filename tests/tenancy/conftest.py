from __future__ import annotations

import pytest

from kvmesh.channels import channel
from kvmesh.v1 import control_plane_pb2_grpc, tenant_admin_pb2 as tpb, tenant_admin_pb2_grpc


@pytest.fixture
def cp_config(redis_server, key_prefix, admin_key):
    from control_plane.config import ControlPlaneConfig

    return ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=key_prefix,
                              lease_ms=60_000, admin_key=admin_key, policy_ttl_s=0)


@pytest.fixture
async def control_plane(cp_config):
    from control_plane.server import serve

    running = await serve(cp_config)
    yield running
    await running.stop()


class Fleet:
    """Talks to one control plane as its admin, and hands out stubs for other keys."""

    def __init__(self, address: str, admin_key: str) -> None:
        self.address = address
        self._channels = []
        self.admin = tenant_admin_pb2_grpc.TenantAdminStub(self._channel(admin_key))
        self.admin_cp = control_plane_pb2_grpc.ControlPlaneStub(self._channel(admin_key))

    def _channel(self, key):
        ch = channel(self.address, key)
        self._channels.append(ch)
        return ch

    def cp(self, key: str | None) -> control_plane_pb2_grpc.ControlPlaneStub:
        return control_plane_pb2_grpc.ControlPlaneStub(self._channel(key))

    def tenant_admin(self, key: str | None) -> tenant_admin_pb2_grpc.TenantAdminStub:
        return tenant_admin_pb2_grpc.TenantAdminStub(self._channel(key))

    async def tenant(self, tenant_id: str, **policy) -> tpb.Tenant:
        return await self.admin.CreateTenant(tpb.CreateTenantRequest(tenant_id=tenant_id,
                                                                     policy=tpb.TenantPolicy(**policy)))

    async def key(self, role: str, **binding) -> tuple[str, str]:
        roles = {"admin": tpb.ROLE_ADMIN, "scheduler": tpb.ROLE_SCHEDULER, "node": tpb.ROLE_NODE}
        reply = await self.admin.IssueKey(tpb.IssueKeyRequest(role=roles[role], **binding))
        return reply.key.key_id, reply.secret

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


@pytest.fixture
async def fleet(control_plane, admin_key):
    f = Fleet(f"127.0.0.1:{control_plane.port}", admin_key)
    yield f
    await f.close()
