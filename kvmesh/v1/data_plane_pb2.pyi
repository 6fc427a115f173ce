from kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STATUS_UNSPECIFIED: _ClassVar[BlockStatus]
    BLOCK_STATUS_HIT: _ClassVar[BlockStatus]
    BLOCK_STATUS_MISS: _ClassVar[BlockStatus]
    BLOCK_STATUS_HIT_PENDING: _ClassVar[BlockStatus]

class PrefetchStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_STATUS_UNSPECIFIED: _ClassVar[PrefetchStatus]
    PREFETCH_STATUS_STARTED: _ClassVar[PrefetchStatus]
    PREFETCH_STATUS_IN_FLIGHT: _ClassVar[PrefetchStatus]
    PREFETCH_STATUS_DISABLED: _ClassVar[PrefetchStatus]
    PREFETCH_STATUS_OVER_CAP: _ClassVar[PrefetchStatus]
BLOCK_STATUS_UNSPECIFIED: BlockStatus
BLOCK_STATUS_HIT: BlockStatus
BLOCK_STATUS_MISS: BlockStatus
BLOCK_STATUS_HIT_PENDING: BlockStatus
PREFETCH_STATUS_UNSPECIFIED: PrefetchStatus
PREFETCH_STATUS_STARTED: PrefetchStatus
PREFETCH_STATUS_IN_FLIGHT: PrefetchStatus
PREFETCH_STATUS_DISABLED: PrefetchStatus
PREFETCH_STATUS_OVER_CAP: PrefetchStatus

class ExchangeAgentMetadataRequest(_message.Message):
    __slots__ = ("node_id", "agent_metadata", "block_bytes", "agent_challenge_answer")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGENT_CHALLENGE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    agent_metadata: bytes
    block_bytes: int
    agent_challenge_answer: bytes
    def __init__(self, node_id: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., agent_challenge_answer: _Optional[bytes] = ...) -> None: ...

class ExchangeAgentMetadataResponse(_message.Message):
    __slots__ = ("node_id", "agent_name", "agent_metadata", "block_bytes", "agent_challenge_sent", "agent_challenge_digest")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGENT_CHALLENGE_SENT_FIELD_NUMBER: _ClassVar[int]
    AGENT_CHALLENGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    agent_name: str
    agent_metadata: bytes
    block_bytes: int
    agent_challenge_sent: bool
    agent_challenge_digest: bytes
    def __init__(self, node_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., agent_challenge_sent: _Optional[bool] = ..., agent_challenge_digest: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "consumer_node_id", "pending_wait_ms", "lease_ms", "media", "landing_addrs", "lease_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    LANDING_ADDRS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    consumer_node_id: str
    pending_wait_ms: int
    lease_ms: int
    media: _containers.RepeatedScalarFieldContainer[_common_pb2.Medium]
    landing_addrs: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., consumer_node_id: _Optional[str] = ..., pending_wait_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ..., media: _Optional[_Iterable[_Union[_common_pb2.Medium, str]]] = ..., landing_addrs: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("statuses", "lease_id", "block_bytes", "checksums", "addrs")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[BlockStatus]
    lease_id: str
    block_bytes: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    addrs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, statuses: _Optional[_Iterable[_Union[BlockStatus, str]]] = ..., lease_id: _Optional[str] = ..., block_bytes: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., addrs: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("settled", "agent_name")
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    settled: bool
    agent_name: str
    def __init__(self, settled: _Optional[bool] = ..., agent_name: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "source_node_id", "source_address", "timeout_ms", "source_media", "first_block_index", "grant", "route_token", "lease_ms", "media")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_MEDIA_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    ROUTE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    source_node_id: str
    source_address: str
    timeout_ms: int
    source_media: _containers.RepeatedScalarFieldContainer[_common_pb2.Medium]
    first_block_index: int
    grant: bytes
    route_token: str
    lease_ms: int
    media: _containers.RepeatedScalarFieldContainer[_common_pb2.Medium]
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., source_node_id: _Optional[str] = ..., source_address: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., source_media: _Optional[_Iterable[_Union[_common_pb2.Medium, str]]] = ..., first_block_index: _Optional[int] = ..., grant: _Optional[bytes] = ..., route_token: _Optional[str] = ..., lease_ms: _Optional[int] = ..., media: _Optional[_Iterable[_Union[_common_pb2.Medium, str]]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("blocks_pulled", "blocks_already_local", "bytes_pulled", "statuses", "lookup_ms", "transfer_ms", "blocks_joined", "refused", "slots", "lease_id")
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_ALREADY_LOCAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_JOINED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    blocks_pulled: int
    blocks_already_local: int
    bytes_pulled: int
    statuses: _containers.RepeatedScalarFieldContainer[BlockStatus]
    lookup_ms: float
    transfer_ms: float
    blocks_joined: int
    refused: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    def __init__(self, blocks_pulled: _Optional[int] = ..., blocks_already_local: _Optional[int] = ..., bytes_pulled: _Optional[int] = ..., statuses: _Optional[_Iterable[_Union[BlockStatus, str]]] = ..., lookup_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., blocks_joined: _Optional[int] = ..., refused: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class DescribeTierRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeTierResponse(_message.Message):
    __slots__ = ("node_id", "shm_path", "block_bytes", "num_slots", "locked", "block_tokens", "peer_public_key")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOCKED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    shm_path: str
    block_bytes: int
    num_slots: int
    locked: bool
    block_tokens: int
    peer_public_key: bytes
    def __init__(self, node_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., block_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., locked: _Optional[bool] = ..., block_tokens: _Optional[int] = ..., peer_public_key: _Optional[bytes] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "max_offload_tokens", "first_block_index", "protected_blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_OFFLOAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    max_offload_tokens: int
    first_block_index: int
    protected_blocks: int
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., max_offload_tokens: _Optional[int] = ..., first_block_index: _Optional[int] = ..., protected_blocks: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "media", "lease_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    media: _containers.RepeatedScalarFieldContainer[_common_pb2.Medium]
    lease_ms: int
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., media: _Optional[_Iterable[_Union[_common_pb2.Medium, str]]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("slots", "lease_id")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    def __init__(self, slots: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "ticket")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    namespace: _common_pb2.Namespace
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ticket: str
    def __init__(self, namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., ticket: _Optional[str] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: PrefetchStatus
    def __init__(self, status: _Optional[_Union[PrefetchStatus, str]] = ...) -> None: ...
