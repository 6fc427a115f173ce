"""Tenancy domain types: tenants, policies, API keys, principals, audit entries."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument, clipped
from kvmesh.namespace import validate_node_id, validate_tenant

MAX_LIST = 256


class Role(enum.IntEnum):
    """Values equal the proto enum."""

    ADMIN = 1
    SCHEDULER = 2
    NODE = 3


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    allowed_nodes: tuple[str, ...] = ()
    allowed_pools: tuple[str, ...] = ()
    shared_with: tuple[str, ...] = ()
    max_index_entries: int = 0
    max_cpu_tier_bytes_per_node: int = 0
    max_namespaces: int = 0  # 0: the control plane's max_namespaces_per_tenant

    def validate(self) -> "TenantPolicy":
        for name in ("allowed_nodes", "allowed_pools", "shared_with"):
            if len(getattr(self, name)) > MAX_LIST:
                raise InvalidArgument(f"policy.{name} has more than {MAX_LIST} entries")
        for tenant in self.shared_with:
            if tenant != "*":
                validate_tenant(tenant)
        for node_id in self.allowed_nodes:
            validate_node_id(node_id)
        for pool in self.allowed_pools:
            if not pool or len(pool) > 128:
                raise InvalidArgument("policy.allowed_pools entries must be 1-128 characters")
        if min(self.max_index_entries, self.max_cpu_tier_bytes_per_node, self.max_namespaces) < 0:
            raise InvalidArgument("policy quotas must not be negative")
        return self

    def allows_node(self, node_id: str, pool: str) -> bool:
        """May the node hold and serve this tenant's blocks?"""
        if not self.allowed_nodes and not self.allowed_pools:
            return True
        return node_id in self.allowed_nodes or (bool(pool) and pool in self.allowed_pools)

    def shares_with(self, tenant_id: str) -> bool:
        return "*" in self.shared_with or tenant_id in self.shared_with


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    display_name: str
    policy: TenantPolicy
    created_unix_ms: int
    redis_user: str
    epoch: str = ""  # changes each time the tenant id is created: keys of a deleted predecessor never match


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    role: Role
    secret_hash: str
    tenant_id: str = ""
    node_id: str = ""
    created_unix_ms: int = 0
    revoked: bool = False
    description: str = ""
    pool: str = ""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: established by authentication, consulted by every authorization check."""

    key_id: str
    role: Role
    tenant_id: str = ""
    node_id: str = ""
    pool: str = ""
    # The key's hash, so grants can be bound to the key that asked for them.
    secret_hash: str = field(default="", repr=False)

    @classmethod
    def from_key(cls, key: ApiKey) -> "Principal":
        return cls(key.key_id, key.role, key.tenant_id, key.node_id, key.pool, key.secret_hash)


AUDIT_FIELD_CHARS = 512


@dataclass(frozen=True, slots=True)
class AuditEntry:
    unix_ms: int
    actor: str
    action: str
    target: str
    outcome: str
    detail: str = ""

    def __post_init__(self) -> None:
        """Each field at most AUDIT_FIELD_CHARS: a caller's ids and the reasons quoting them are strings of up to
        the request size (16 MiB), and the stream is every tenant's Redis (and what `kvmesh admin audit` reads)."""
        for name in ("actor", "action", "target", "outcome", "detail"):
            value = getattr(self, name)
            if len(value) > AUDIT_FIELD_CHARS:
                object.__setattr__(self, name, clipped(value, AUDIT_FIELD_CHARS))
