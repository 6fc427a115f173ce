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
ACK_STATUS_UNSPECIFIED: AckStatus
ACK_STATUS_APPLIED: AckStatus
ACK_STATUS_DUPLICATE: AckStatus
ACK_STATUS_RESYNC_REQUIRED: AckStatus

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
    __slots__ = ("seq", "status", "expected_seq", "blocks_applied")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    status: AckStatus
    expected_seq: int
    blocks_applied: int
    def __init__(self, seq: _Optional[int] = ..., status: _Optional[_Union[AckStatus, str]] = ..., expected_seq: _Optional[int] = ..., blocks_applied: _Optional[int] = ...) -> None: ...

class LookupPrefixRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "token_ids", "extras", "media")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extras: _common_pb2.HashExtras
    media: _containers.RepeatedScalarFieldContainer[_common_pb2.Medium]
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., extras: _Optional[_Union[_common_pb2.HashExtras, _Mapping]] = ..., media: _Optional[_Iterable[_Union[_common_pb2.Medium, str]]] = ...) -> None: ...

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
