from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_UNSPECIFIED: _ClassVar[Medium]
    MEDIUM_GPU: _ClassVar[Medium]
    MEDIUM_CPU: _ClassVar[Medium]
    MEDIUM_DISK: _ClassVar[Medium]

class HashAlgo(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HASH_ALGO_UNSPECIFIED: _ClassVar[HashAlgo]
    HASH_ALGO_SHA256_CBOR: _ClassVar[HashAlgo]
    HASH_ALGO_SHA256: _ClassVar[HashAlgo]
    HASH_ALGO_XXHASH_CBOR: _ClassVar[HashAlgo]
MEDIUM_UNSPECIFIED: Medium
MEDIUM_GPU: Medium
MEDIUM_CPU: Medium
MEDIUM_DISK: Medium
HASH_ALGO_UNSPECIFIED: HashAlgo
HASH_ALGO_SHA256_CBOR: HashAlgo
HASH_ALGO_SHA256: HashAlgo
HASH_ALGO_XXHASH_CBOR: HashAlgo

class CacheConfig(_message.Message):
    __slots__ = ("block_size", "kv_dtype", "kv_layout", "parallel_layout", "hash_algo", "hash_seed")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    kv_dtype: str
    kv_layout: str
    parallel_layout: str
    hash_algo: HashAlgo
    hash_seed: str
    def __init__(self, block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., kv_layout: _Optional[str] = ..., parallel_layout: _Optional[str] = ..., hash_algo: _Optional[_Union[HashAlgo, str]] = ..., hash_seed: _Optional[str] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("tenant", "model", "weight_version", "cache_config")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    weight_version: str
    cache_config: CacheConfig
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., weight_version: _Optional[str] = ..., cache_config: _Optional[_Union[CacheConfig, _Mapping]] = ...) -> None: ...

class HashExtras(_message.Message):
    __slots__ = ("lora_name", "lora_path", "cache_salt")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    cache_salt: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
