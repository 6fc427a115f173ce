"""A canonical digest of a protobuf request: what a proof of possession signs (tenancy.peer_proof).

Both ends compute it from the message's fields, never from its wire bytes: the caller before it sends, the
server from the request it decoded. Every set field counts, in field-number order, each value framed by its
type and length, so no two different requests share an encoding (whatever order or packing a client's
serializer used). Proto3 fields at their default are absent on both ends (the server cannot tell them from
unset ones either); unknown fields are not covered (no handler reads them).

Any request type works: a new field, or a new peer RPC, is covered without a list to keep in sync.

Long repeated fields (a pull's 1,024 block hashes and landing addresses) are framed in one native call each
(:func:`_repeated`): the same bytes as framing each value, without a Python step per value.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Callable

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_DOMAIN = b"kvmesh-request-digest-v1\n"
_DOUBLE = struct.Struct(">d")
_LENGTH = struct.Struct(">Q")


def request_digest(message: Message) -> bytes:
    """The SHA-256 of ``message``'s canonical encoding (its type's full name, then every set field)."""
    return hashlib.sha256(_DOMAIN + _encode(message)).digest()


def _encode(message: Message) -> bytes:
    parts = [_framed(message.DESCRIPTOR.full_name.encode())]
    for field, value in message.ListFields():  # set fields, in field-number order
        parts.append(struct.pack(">I", field.number))
        if _is_map(field):
            entries = sorted(value.items())
            key, val = (_encoder(field.message_type.fields_by_name[n]) for n in ("key", "value"))
            parts.append(struct.pack(">Q", len(entries)))
            parts += [key(k) + val(v) for k, v in entries]
        elif field.is_repeated:
            parts.append(struct.pack(">Q", len(value)))
            parts.append(_repeated(field, value))
        else:
            parts.append(_encoder(field)(value))
    return b"".join(parts)


def _encoder(field: FieldDescriptor) -> Callable[[object], bytes]:
    """How one value of ``field`` is framed."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return lambda v: _framed(_encode(v))
    if field.type == FieldDescriptor.TYPE_STRING:
        return lambda v: _framed(v.encode())
    if field.type == FieldDescriptor.TYPE_BYTES:
        return _framed
    if field.type == FieldDescriptor.TYPE_BOOL:
        return lambda v: b"\x01" if v else b"\x00"
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return _DOUBLE.pack
    return _integer  # every integer and enum type (uint64 included)


_UNSIGNED = frozenset({FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED32,
                       FieldDescriptor.TYPE_FIXED64})
_SIGNED = frozenset({FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT32,
                     FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_SFIXED64,
                     FieldDescriptor.TYPE_ENUM})
_SHORT = 16  # values below which framing one by one is as quick


def _repeated(field: FieldDescriptor, values) -> bytes:
    """The values of a repeated field, each framed as :func:`_encoder` frames it, concatenated: integers as
    9-byte big-endian two's complement rows built by numpy, byte strings of one length joined behind their
    common length prefix."""
    if len(values) >= _SHORT:
        if field.type in _UNSIGNED or field.type in _SIGNED:
            ints = np.array(values, dtype=np.uint64 if field.type in _UNSIGNED else np.int64)
            rows = np.empty((len(ints), 9), dtype=np.uint8)
            rows[:, 0] = np.where(ints < 0, 0xFF, 0) if ints.dtype == np.int64 else 0
            rows[:, 1:] = ints.astype(">u8" if ints.dtype == np.uint64 else ">i8").view(np.uint8).reshape(-1, 8)
            return rows.tobytes()
        if field.type == FieldDescriptor.TYPE_BYTES:
            values = list(values)
            if len(set(map(len, values))) == 1:
                prefix = _LENGTH.pack(len(values[0]))
                return prefix + prefix.join(values)
    return b"".join(map(_encoder(field), values))


def _integer(value: int) -> bytes:
    return value.to_bytes(9, "big", signed=True)


def _framed(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry
