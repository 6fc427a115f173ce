"""The TenantAdmin gRPC servicer. Every call needs the admin role and is audited."""

from __future__ import annotations

import time

from kvmesh.grpc_errors import grpc_errors
from kvmesh.v1 import tenant_admin_pb2 as pb, tenant_admin_pb2_grpc as pb_grpc

from tenancy import wire
from tenancy.auth import current_principal
from tenancy.authz import Authorizer
from tenancy.model import AuditEntry
from tenancy.store import RedisTenantStore


class TenantAdminServicer(pb_grpc.TenantAdminServicer):
    def __init__(self, store: RedisTenantStore, authz: Authorizer) -> None:
        self._store = store
        self._authz = authz

    async def _admin(self, action: str, target: str = "") -> str:
        principal = current_principal()
        await self._authz.require_admin(principal, action, target)
        return principal.key_id

    async def _audit(self, actor: str, action: str, target: str, detail: str = "") -> None:
        await self._store.audit(AuditEntry(int(time.time() * 1000), actor, action, target, "ok", detail))

    @grpc_errors
    async def CreateTenant(self, request, context):
        actor = await self._admin("CreateTenant", request.tenant_id)
        tenant = await self._store.create_tenant(request.tenant_id, request.display_name, wire.policy(request.policy))
        await self._audit(actor, "CreateTenant", request.tenant_id)
        return wire.tenant_to_pb(tenant)

    @grpc_errors
    async def ListTenants(self, request, context):
        await self._admin("ListTenants")
        return pb.ListTenantsResponse(tenants=[wire.tenant_to_pb(t) for t in await self._store.list_tenants()])

    @grpc_errors
    async def GetTenant(self, request, context):
        await self._admin("GetTenant", request.tenant_id)
        tenant = await self._store.get_tenant(request.tenant_id)
        return wire.tenant_to_pb(tenant, await self._store.index_entries(request.tenant_id))

    @grpc_errors
    async def DeleteTenant(self, request, context):
        actor = await self._admin("DeleteTenant", request.tenant_id)
        await self._store.delete_tenant(request.tenant_id)
        self._authz.forget(request.tenant_id)
        await self._audit(actor, "DeleteTenant", request.tenant_id)
        return pb.DeleteTenantResponse()

    @grpc_errors
    async def SetPolicy(self, request, context):
        actor = await self._admin("SetPolicy", request.tenant_id)
        tenant = await self._store.set_policy(request.tenant_id, wire.policy(request.policy))
        self._authz.forget(request.tenant_id)
        await self._audit(actor, "SetPolicy", request.tenant_id)
        return wire.tenant_to_pb(tenant)

    @grpc_errors
    async def IssueKey(self, request, context):
        actor = await self._admin("IssueKey", request.tenant_id or request.node_id)
        key, secret = await self._store.issue_key(wire.role(request.role), tenant_id=request.tenant_id,
                                                  node_id=request.node_id, pool=request.pool,
                                                  description=request.description)
        await self._audit(actor, "IssueKey", key.key_id, f"role={key.role.name.lower()}")
        return pb.IssueKeyResponse(key=wire.key_to_pb(key), secret=secret)

    @grpc_errors
    async def ListKeys(self, request, context):
        await self._admin("ListKeys", request.tenant_id)
        return pb.ListKeysResponse(keys=[wire.key_to_pb(k) for k in await self._store.list_keys(request.tenant_id)])

    @grpc_errors
    async def RotateKey(self, request, context):
        actor = await self._admin("RotateKey", request.key_id)
        key, secret = await self._store.rotate_key(request.key_id)
        await self._audit(actor, "RotateKey", request.key_id, f"new key {key.key_id}")
        return pb.IssueKeyResponse(key=wire.key_to_pb(key), secret=secret)

    @grpc_errors
    async def RevokeKey(self, request, context):
        actor = await self._admin("RevokeKey", request.key_id)
        await self._store.revoke_key(request.key_id)
        await self._audit(actor, "RevokeKey", request.key_id)
        return pb.RevokeKeyResponse()

    @grpc_errors
    async def RotateRedisCredentials(self, request, context):
        actor = await self._admin("RotateRedisCredentials", request.tenant_id)
        tenant = await self._store.rotate_redis_password(request.tenant_id)
        await self._audit(actor, "RotateRedisCredentials", request.tenant_id)
        return wire.tenant_to_pb(tenant)

    @grpc_errors
    async def ListAudit(self, request, context):
        await self._admin("ListAudit")
        entries = await self._store.list_audit(min(request.limit or 100, 10_000))
        return pb.ListAuditResponse(entries=[wire.audit_to_pb(e) for e in entries])
