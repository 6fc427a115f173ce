"""Proto <-> domain conversions for tenant administration."""

from __future__ import annotations

from kvmesh.errors import InvalidArgument
from kvmesh.v1 import tenant_admin_pb2 as pb

from tenancy.model import ApiKey, AuditEntry, Role, Tenant, TenantPolicy


def role(value: int) -> Role:
    try:
        return Role(value)
    except ValueError:
        raise InvalidArgument("role must be ADMIN, SCHEDULER or NODE") from None


def policy(msg: pb.TenantPolicy) -> TenantPolicy:
    return TenantPolicy(tuple(msg.allowed_nodes), tuple(msg.allowed_pools), tuple(msg.shared_with),
                        msg.max_index_entries, msg.max_cpu_tier_bytes_per_node, msg.max_namespaces).validate()


def policy_to_pb(p: TenantPolicy) -> pb.TenantPolicy:
    return pb.TenantPolicy(allowed_nodes=p.allowed_nodes, allowed_pools=p.allowed_pools, shared_with=p.shared_with,
                           max_index_entries=p.max_index_entries,
                           max_cpu_tier_bytes_per_node=p.max_cpu_tier_bytes_per_node,
                           max_namespaces=p.max_namespaces)


def tenant_to_pb(t: Tenant, index_entries: int = 0) -> pb.Tenant:
    return pb.Tenant(tenant_id=t.tenant_id, display_name=t.display_name, policy=policy_to_pb(t.policy),
                     created_unix_ms=t.created_unix_ms, redis_user=t.redis_user, index_entries=index_entries)


def key_to_pb(k: ApiKey) -> pb.ApiKeyInfo:
    return pb.ApiKeyInfo(key_id=k.key_id, tenant_id=k.tenant_id, role=int(k.role), node_id=k.node_id,
                         created_unix_ms=k.created_unix_ms, revoked=k.revoked, description=k.description,
                         pool=k.pool)


def audit_to_pb(e: AuditEntry) -> pb.AuditEntry:
    return pb.AuditEntry(unix_ms=e.unix_ms, actor=e.actor, action=e.action, target=e.target, outcome=e.outcome,
                         detail=e.detail)
