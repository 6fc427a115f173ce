"""Authorization decisions for the control plane, by role, tenant and policy.

| role | may |
|---|---|
| admin | everything (tenant administration, any namespace) |
| scheduler | look up / route / get grants for its tenant's namespaces, and namespaces shared with it |
| node | register and publish as its own node id; look up and get grants for tenants whose policy allows it |

Denials raise PermissionDenied and are audited. Lookups a principal may not
make are not denied: :meth:`Authorizer.may_read` lets the caller answer them
exactly like a lookup of absent blocks, so a denial reveals nothing.
Tenant policies are cached for ``policy_ttl_s`` (changes reach every replica
within it); keys are never cached (see tenancy.auth).
"""

from __future__ import annotations

import time

from kvmesh.errors import PermissionDenied, clipped
from kvmesh.namespace import valid_tenant
from tenancy.auth import AuditSink
from tenancy.model import AuditEntry, Principal, Role, Tenant
from tenancy.store import RedisTenantStore

# Tenant ids whose policy (or absence) is cached: any caller names any tenant id in a request, so past this many the
# oldest entry goes (unbounded, a key holder naming made-up tenants grew the cache by ~400 bytes a call, for good).
MAX_CACHED_TENANTS = 4096


class Authorizer:
    def __init__(self, store: RedisTenantStore, audit: AuditSink, policy_ttl_s: float = 2.0) -> None:
        self._store = store
        self._audit = audit
        self._ttl = policy_ttl_s
        self._cache: dict[str, tuple[float, Tenant | None]] = {}

    async def tenant(self, tenant_id: str) -> Tenant | None:
        """The tenant (None: no such tenant, or not a valid tenant id: not looked up, not cached)."""
        if not valid_tenant(tenant_id):
            return None
        hit = self._cache.get(tenant_id)
        now = time.monotonic()
        if hit and now - hit[0] < self._ttl:
            return hit[1]
        tenant = await self._store.find_tenant(tenant_id)
        if tenant_id not in self._cache and len(self._cache) >= MAX_CACHED_TENANTS:
            del self._cache[next(iter(self._cache))]  # the oldest entry
        self._cache[tenant_id] = (now, tenant)
        return tenant

    def forget(self, tenant_id: str) -> None:
        self._cache.pop(tenant_id, None)

    async def deny(self, principal: Principal, action: str, target: str, reason: str) -> PermissionDenied:
        await self._audit(AuditEntry(int(time.time() * 1000), principal.key_id, f"denied:{action}", target,
                                     "PERMISSION_DENIED", reason))
        return PermissionDenied(clipped(reason, 512))

    async def require_admin(self, principal: Principal, action: str, target: str = "") -> None:
        if principal.role is not Role.ADMIN:
            raise await self.deny(principal, action, target, f"{action} needs the admin role")

    async def require_node(self, principal: Principal, node_id: str, action: str) -> None:
        """The caller is node ``node_id`` (or an admin)."""
        if principal.role is Role.ADMIN:
            return
        if principal.role is not Role.NODE or principal.node_id != node_id:
            raise await self.deny(principal, action, node_id, f"{action} for node {node_id!r} needs that node's key")

    async def node_may_hold(self, principal: Principal, tenant_id: str) -> bool:
        tenant = await self.tenant(tenant_id)
        return tenant is not None and tenant.policy.allows_node(principal.node_id, principal.pool)

    async def may_read(self, principal: Principal, tenant_id: str) -> bool:
        """May the principal learn what is cached for ``tenant_id`` (look up, route, get grants)?"""
        if principal.role is Role.ADMIN:
            return True
        if principal.role is Role.SCHEDULER:
            if principal.tenant_id == tenant_id:
                return True
            tenant = await self.tenant(tenant_id)
            return tenant is not None and tenant.policy.shares_with(principal.tenant_id)
        if principal.role is Role.NODE:
            return await self.node_may_hold(principal, tenant_id)
        return False
