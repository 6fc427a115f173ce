from kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_STATUS_UNSPECIFIED: _ClassVar[AckStatus]
    ACK_STATUS_APPLIED: _ClassVar[AckStatus]
    ACK_STATUS_DUPLICATE: _ClassVar[AckStatus]
    ACK_STATUS_RESYNC_REQUIRED: _ClassVar[AckStatus]
    ACK_STATUS_REFUSED: _ClassVar[AckStatus]

class RoutePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_POLICY_UNSPECIFIED: _ClassVar[RoutePolicy]
    ROUTE_POLICY_AFFINITY: _ClassVar[RoutePolicy]
    ROUTE_POLICY_LOAD_AWARE: _ClassVar[RoutePolicy]
    ROUTE_POLICY_TOKEN_AWARE: _ClassVar[RoutePolicy]
    ROUTE_POLICY_COST_AWARE: _ClassVar[RoutePolicy]

class RouteReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_REASON_UNSPECIFIED: _ClassVar[RouteReason]
    ROUTE_REASON_LONGEST_LOCAL_PREFIX: _ClassVar[RouteReason]
    ROUTE_REASON_LEAST_LOADED: _ClassVar[RouteReason]
    ROUTE_REASON_FEWEST_TOKENS_TO_PREFILL: _ClassVar[RouteReason]
    ROUTE_REASON_LOWEST_ESTIMATED_TTFT: _ClassVar[RouteReason]

class SourceDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_DECISION_UNSPECIFIED: _ClassVar[SourceDecision]
    SOURCE_DECISION_PULL: _ClassVar[SourceDecision]
    SOURCE_DECISION_NONE_AHEAD: _ClassVar[SourceDecision]
    SOURCE_DECISION_BELOW_MIN_DELTA: _ClassVar[SourceDecision]
    SOURCE_DECISION_RECOMPUTE_CHEAPER: _ClassVar[SourceDecision]
    SOURCE_DECISION_P2P_DISABLED: _ClassVar[SourceDecision]
ACK_STATUS_UNSPECIFIED: AckStatus
ACK_STATUS_APPLIED: AckStatus
ACK_STATUS_DUPLICATE: AckStatus
ACK_STATUS_RESYNC_REQUIRED: AckStatus
ACK_STATUS_REFUSED: AckStatus
ROUTE_POLICY_UNSPECIFIED: RoutePolicy
ROUTE_POLICY_AFFINITY: RoutePolicy
ROUTE_POLICY_LOAD_AWARE: RoutePolicy
ROUTE_POLICY_TOKEN_AWARE: RoutePolicy
ROUTE_POLICY_COST_AWARE: RoutePolicy
ROUTE_REASON_UNSPECIFIED: RouteReason
ROUTE_REASON_LONGEST_LOCAL_PREFIX: RouteReason
ROUTE_REASON_LEAST_LOADED: RouteReason
ROUTE_REASON_FEWEST_TOKENS_TO_PREFILL: RouteReason
ROUTE_REASON_LOWEST_ESTIMATED_TTFT: RouteReason
SOURCE_DECISION_UNSPECIFIED: SourceDecision
SOURCE_DECISION_PULL: SourceDecision
SOURCE_DECISION_NONE_AHEAD: SourceDecision
SOURCE_DECISION_BELOW_MIN_DELTA: SourceDecision
SOURCE_DECISION_RECOMPUTE_CHEAPER: SourceDecision
SOURCE_DECISION_P2P_DISABLED: SourceDecision

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "data_plane_address", "pool", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_plane_address: str
    pool: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, node_id: _Optional[str] = ..., data_plane_address: _Optional[str] = ..., pool: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("incarnation", "lease_ms", "next_seq")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    lease_ms: int
    next_seq: int
    def __init__(self, incarnation: _Optional[int] = ..., lease_ms: _Optional[int] = ..., next_seq: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

class DeregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DeregisterNodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "incarnation", "live", "last_seq", "lease_expires_unix_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    incarnation: int
    live: bool
    last_seq: int
    lease_expires_unix_ms: int
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., incarnation: _Optional[int] = ..., live: _Optional[bool] = ..., last_seq: _Optional[int] = ..., lease_expires_unix_ms: _Optional[int] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "locality", "extras")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: _common_pb2.Medium
    locality: str
    extras: _common_pb2.HashExtras
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[_Union[_common_pb2.Medium, str]] = ..., locality: _Optional[str] = ..., extras: _Optional[_Union[_common_pb2.HashExtras, _Mapping]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: _common_pb2.Medium
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[_Union[_common_pb2.Medium, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ("medium",)
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    medium: _common_pb2.Medium
    def __init__(self, medium: _Optional[_Union[_common_pb2.Medium, str]] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("node_id", "incarnation", "seq", "namespace", "reset", "events")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    seq: int
    namespace: _common_pb2.Namespace
    reset: bool
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., reset: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class EventAck(_message.Message):
    __slots__ = ("seq", "status", "expected_seq", "blocks_applied", "detail")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    status: AckStatus
    expected_seq: int
    blocks_applied: int
    detail: str
    def __init__(self, seq: _Optional[int] = ..., status: _Optional[_Union[AckStatus, str]] = ..., expected_seq: _Optional[int] = ..., blocks_applied: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class LookupPrefixRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "token_ids", "extras", "media", "packed_block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extras: _common_pb2.HashExtras
    media: _containers.RepeatedScalarFieldContainer[_common_pb2.Medium]
    packed_block_hashes: bytes
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., extras: _Optional[_Union[_common_pb2.HashExtras, _Mapping]] = ..., media: _Optional[_Iterable[_Union[_common_pb2.Medium, str]]] = ..., packed_block_hashes: _Optional[bytes] = ...) -> None: ...

class LookupPrefixBatch(_message.Message):
    __slots__ = ("lookups",)
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    lookups: _containers.RepeatedCompositeFieldContainer[LookupPrefixRequest]
    def __init__(self, lookups: _Optional[_Iterable[_Union[LookupPrefixRequest, _Mapping]]] = ...) -> None: ...

class LookupPrefixBatchResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[LookupPrefixResponse]
    def __init__(self, answers: _Optional[_Iterable[_Union[LookupPrefixResponse, _Mapping]]] = ...) -> None: ...

class TierPrefix(_message.Message):
    __slots__ = ("medium", "leading_blocks")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    LEADING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    medium: _common_pb2.Medium
    leading_blocks: int
    def __init__(self, medium: _Optional[_Union[_common_pb2.Medium, str]] = ..., leading_blocks: _Optional[int] = ...) -> None: ...

class NodePrefix(_message.Message):
    __slots__ = ("node_id", "data_plane_address", "leading_blocks", "tiers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_plane_address: str
    leading_blocks: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierPrefix]
    def __init__(self, node_id: _Optional[str] = ..., data_plane_address: _Optional[str] = ..., leading_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierPrefix, _Mapping]]] = ...) -> None: ...

class LookupPrefixResponse(_message.Message):
    __slots__ = ("blocks_queried", "holders", "block_hashes")
    BLOCKS_QUERIED_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    blocks_queried: int
    holders: _containers.RepeatedCompositeFieldContainer[NodePrefix]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, blocks_queried: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[NodePrefix, _Mapping]]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class IssuePullGrantRequest(_message.Message):
    __slots__ = ("namespace", "source_node_id", "consumer_public_key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    source_node_id: str
    consumer_public_key: bytes
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., source_node_id: _Optional[str] = ..., consumer_public_key: _Optional[bytes] = ...) -> None: ...

class PullGrant(_message.Message):
    __slots__ = ("token", "expires_unix_ms", "source_address")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    expires_unix_ms: int
    source_address: str
    def __init__(self, token: _Optional[bytes] = ..., expires_unix_ms: _Optional[int] = ..., source_address: _Optional[str] = ...) -> None: ...

class GetGrantKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GrantKey(_message.Message):
    __slots__ = ("key_id", "ed25519_public_key", "current")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    ED25519_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    ed25519_public_key: bytes
    current: bool
    def __init__(self, key_id: _Optional[str] = ..., ed25519_public_key: _Optional[bytes] = ..., current: _Optional[bool] = ...) -> None: ...

class GetGrantKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[GrantKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[GrantKey, _Mapping]]] = ...) -> None: ...

class EngineCandidate(_message.Message):
    __slots__ = ("engine_id", "node_id", "waiting_requests", "running_tokens")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    node_id: str
    waiting_requests: int
    running_tokens: int
    def __init__(self, engine_id: _Optional[str] = ..., node_id: _Optional[str] = ..., waiting_requests: _Optional[int] = ..., running_tokens: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "token_ids", "extras", "prompt_tokens", "candidates", "policy", "disable_p2p", "min_cached_token_delta", "kv_bytes_per_token", "kv_request_id", "disable_prefetch")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DISABLE_P2P_FIELD_NUMBER: _ClassVar[int]
    MIN_CACHED_TOKEN_DELTA_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DISABLE_PREFETCH_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extras: _common_pb2.HashExtras
    prompt_tokens: int
    candidates: _containers.RepeatedCompositeFieldContainer[EngineCandidate]
    policy: RoutePolicy
    disable_p2p: bool
    min_cached_token_delta: int
    kv_bytes_per_token: int
    kv_request_id: str
    disable_prefetch: bool
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., extras: _Optional[_Union[_common_pb2.HashExtras, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[EngineCandidate, _Mapping]]] = ..., policy: _Optional[_Union[RoutePolicy, str]] = ..., disable_p2p: _Optional[bool] = ..., min_cached_token_delta: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., kv_request_id: _Optional[str] = ..., disable_prefetch: _Optional[bool] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("node_id", "host", "port", "tier", "cached_tokens", "kv_request_id", "route_token")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    port: int
    tier: _common_pb2.Medium
    cached_tokens: int
    kv_request_id: str
    route_token: str
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., tier: _Optional[_Union[_common_pb2.Medium, str]] = ..., cached_tokens: _Optional[int] = ..., kv_request_id: _Optional[str] = ..., route_token: _Optional[str] = ...) -> None: ...

class RouteEstimate(_message.Message):
    __slots__ = ("queue_ms", "lookup_ms", "transfer_ms", "promotion_ms", "prefill_ms", "ttft_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    PROMOTION_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    lookup_ms: float
    transfer_ms: float
    promotion_ms: float
    prefill_ms: float
    ttft_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., lookup_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., promotion_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("engine_id", "kv_source", "reason", "source_decision", "prompt_tokens", "local_cached_tokens", "estimate", "remote_kv_source_json", "explanation", "prefetch")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DECISION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_KV_SOURCE_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    kv_source: KvSource
    reason: RouteReason
    source_decision: SourceDecision
    prompt_tokens: int
    local_cached_tokens: int
    estimate: RouteEstimate
    remote_kv_source_json: str
    explanation: str
    prefetch: PrefetchOrder
    def __init__(self, engine_id: _Optional[str] = ..., kv_source: _Optional[_Union[KvSource, _Mapping]] = ..., reason: _Optional[_Union[RouteReason, str]] = ..., source_decision: _Optional[_Union[SourceDecision, str]] = ..., prompt_tokens: _Optional[int] = ..., local_cached_tokens: _Optional[int] = ..., estimate: _Optional[_Union[RouteEstimate, _Mapping]] = ..., remote_kv_source_json: _Optional[str] = ..., explanation: _Optional[str] = ..., prefetch: _Optional[_Union[PrefetchOrder, _Mapping]] = ...) -> None: ...

class PrefetchOrder(_message.Message):
    __slots__ = ("node_id", "data_plane_address", "ticket", "block_hashes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_plane_address: str
    ticket: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, node_id: _Optional[str] = ..., data_plane_address: _Optional[str] = ..., ticket: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LinkSample(_message.Message):
    __slots__ = ("source_node_id", "dest_node_id", "bytes_per_s")
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    source_node_id: str
    dest_node_id: str
    bytes_per_s: float
    def __init__(self, source_node_id: _Optional[str] = ..., dest_node_id: _Optional[str] = ..., bytes_per_s: _Optional[float] = ...) -> None: ...

class EngineSample(_message.Message):
    __slots__ = ("engine_id", "prefill_tokens_per_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    prefill_tokens_per_s: float
    def __init__(self, engine_id: _Optional[str] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class PullOutcome(_message.Message):
    __slots__ = ("source_node_id", "blocks_routed", "blocks_hit")
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HIT_FIELD_NUMBER: _ClassVar[int]
    source_node_id: str
    blocks_routed: int
    blocks_hit: int
    def __init__(self, source_node_id: _Optional[str] = ..., blocks_routed: _Optional[int] = ..., blocks_hit: _Optional[int] = ...) -> None: ...

class ReportStatsRequest(_message.Message):
    __slots__ = ("links", "engines", "pulls")
    LINKS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkSample]
    engines: _containers.RepeatedCompositeFieldContainer[EngineSample]
    pulls: _containers.RepeatedCompositeFieldContainer[PullOutcome]
    def __init__(self, links: _Optional[_Iterable[_Union[LinkSample, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[EngineSample, _Mapping]]] = ..., pulls: _Optional[_Iterable[_Union[PullOutcome, _Mapping]]] = ...) -> None: ...

class ReportStatsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTenantLimitsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TenantLimits(_message.Message):
    __slots__ = ("max_cpu_tier_bytes_per_node", "tenant_epoch")
    MAX_CPU_TIER_BYTES_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    TENANT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    max_cpu_tier_bytes_per_node: int
    tenant_epoch: str
    def __init__(self, max_cpu_tier_bytes_per_node: _Optional[int] = ..., tenant_epoch: _Optional[str] = ...) -> None: ...

class WatchBlockMapRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ...) -> None: ...

class BlockMapHolder(_message.Message):
    __slots__ = ("slot", "node_id", "data_plane_address", "lease_until_unix_ms", "removed")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_UNTIL_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    slot: int
    node_id: str
    data_plane_address: str
    lease_until_unix_ms: int
    removed: bool
    def __init__(self, slot: _Optional[int] = ..., node_id: _Optional[str] = ..., data_plane_address: _Optional[str] = ..., lease_until_unix_ms: _Optional[int] = ..., removed: _Optional[bool] = ...) -> None: ...

class BlockMapUpdate(_message.Message):
    __slots__ = ("reset", "synced", "holders", "keys", "values", "value_index", "server_time_unix_ms")
    RESET_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VALUE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    synced: bool
    holders: _containers.RepeatedCompositeFieldContainer[BlockMapHolder]
    keys: bytes
    values: _containers.RepeatedScalarFieldContainer[bytes]
    value_index: bytes
    server_time_unix_ms: int
    def __init__(self, reset: _Optional[bool] = ..., synced: _Optional[bool] = ..., holders: _Optional[_Iterable[_Union[BlockMapHolder, _Mapping]]] = ..., keys: _Optional[bytes] = ..., values: _Optional[_Iterable[bytes]] = ..., value_index: _Optional[bytes] = ..., server_time_unix_ms: _Optional[int] = ...) -> None: ...
