from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ADMIN: _ClassVar[Role]
    ROLE_SCHEDULER: _ClassVar[Role]
    ROLE_NODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_ADMIN: Role
ROLE_SCHEDULER: Role
ROLE_NODE: Role

class TenantPolicy(_message.Message):
    __slots__ = ("allowed_nodes", "allowed_pools", "shared_with", "max_index_entries", "max_cpu_tier_bytes_per_node", "max_namespaces")
    ALLOWED_NODES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_POOLS_FIELD_NUMBER: _ClassVar[int]
    SHARED_WITH_FIELD_NUMBER: _ClassVar[int]
    MAX_INDEX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_TIER_BYTES_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    MAX_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    allowed_nodes: _containers.RepeatedScalarFieldContainer[str]
    allowed_pools: _containers.RepeatedScalarFieldContainer[str]
    shared_with: _containers.RepeatedScalarFieldContainer[str]
    max_index_entries: int
    max_cpu_tier_bytes_per_node: int
    max_namespaces: int
    def __init__(self, allowed_nodes: _Optional[_Iterable[str]] = ..., allowed_pools: _Optional[_Iterable[str]] = ..., shared_with: _Optional[_Iterable[str]] = ..., max_index_entries: _Optional[int] = ..., max_cpu_tier_bytes_per_node: _Optional[int] = ..., max_namespaces: _Optional[int] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("tenant_id", "display_name", "policy", "created_unix_ms", "redis_user", "index_entries")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REDIS_USER_FIELD_NUMBER: _ClassVar[int]
    INDEX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    display_name: str
    policy: TenantPolicy
    created_unix_ms: int
    redis_user: str
    index_entries: int
    def __init__(self, tenant_id: _Optional[str] = ..., display_name: _Optional[str] = ..., policy: _Optional[_Union[TenantPolicy, _Mapping]] = ..., created_unix_ms: _Optional[int] = ..., redis_user: _Optional[str] = ..., index_entries: _Optional[int] = ...) -> None: ...

class CreateTenantRequest(_message.Message):
    __slots__ = ("tenant_id", "display_name", "policy")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    display_name: str
    policy: TenantPolicy
    def __init__(self, tenant_id: _Optional[str] = ..., display_name: _Optional[str] = ..., policy: _Optional[_Union[TenantPolicy, _Mapping]] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ...) -> None: ...

class GetTenantRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class DeleteTenantRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class DeleteTenantResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("tenant_id", "policy")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    policy: TenantPolicy
    def __init__(self, tenant_id: _Optional[str] = ..., policy: _Optional[_Union[TenantPolicy, _Mapping]] = ...) -> None: ...

class ApiKeyInfo(_message.Message):
    __slots__ = ("key_id", "tenant_id", "role", "node_id", "created_unix_ms", "revoked", "description", "pool")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    tenant_id: str
    role: Role
    node_id: str
    created_unix_ms: int
    revoked: bool
    description: str
    pool: str
    def __init__(self, key_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., node_id: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., revoked: _Optional[bool] = ..., description: _Optional[str] = ..., pool: _Optional[str] = ...) -> None: ...

class IssueKeyRequest(_message.Message):
    __slots__ = ("role", "tenant_id", "node_id", "description", "pool")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    role: Role
    tenant_id: str
    node_id: str
    description: str
    pool: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., tenant_id: _Optional[str] = ..., node_id: _Optional[str] = ..., description: _Optional[str] = ..., pool: _Optional[str] = ...) -> None: ...

class IssueKeyResponse(_message.Message):
    __slots__ = ("key", "secret")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    key: ApiKeyInfo
    secret: str
    def __init__(self, key: _Optional[_Union[ApiKeyInfo, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKeyInfo]
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKeyInfo, _Mapping]]] = ...) -> None: ...

class RotateKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class RevokeKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class RevokeKeyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RotateRedisCredentialsRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class ListAuditRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class AuditEntry(_message.Message):
    __slots__ = ("unix_ms", "actor", "action", "target", "outcome", "detail")
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    unix_ms: int
    actor: str
    action: str
    target: str
    outcome: str
    detail: str
    def __init__(self, unix_ms: _Optional[int] = ..., actor: _Optional[str] = ..., action: _Optional[str] = ..., target: _Optional[str] = ..., outcome: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ListAuditResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AuditEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[AuditEntry, _Mapping]]] = ...) -> None: ...
