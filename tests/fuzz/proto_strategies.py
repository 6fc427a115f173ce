"""Hypothesis strategies built from the proto schemas: walk a message descriptor, draw every field.

Random values rarely get past the first validation, so fields that name a namespace, a block hash or a block
size draw either a plausible value (reaching the code behind validation) or an arbitrary one.
"""

from __future__ import annotations

from typing import Any, Callable

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from kvmesh.v1 import common_pb2

F = FieldDescriptor
MAX_DEPTH = 3

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}


def plausible_namespace(tenant: str) -> st.SearchStrategy:
    return st.builds(lambda bs, algo: common_pb2.Namespace(
        tenant=tenant, model="fuzz-model", weight_version="v1",
        cache_config=common_pb2.CacheConfig(block_size=bs, hash_algo=algo)),
        st.sampled_from([32, 16, 0, 33]), st.sampled_from([0, 1, 2, 3, 99]))


def _small_ints(lo: int, hi: int) -> st.SearchStrategy:
    small = st.integers(max(lo, -5), min(hi, 70_000))
    return st.one_of(small, st.integers(lo, hi), st.sampled_from([lo, hi]))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    base: st.SearchStrategy
    if field.type == F.TYPE_STRING:
        base = st.text(max_size=40)
    elif field.type == F.TYPE_BYTES:
        base = st.one_of(st.binary(max_size=64), st.binary(min_size=32, max_size=32))
    elif field.type == F.TYPE_BOOL:
        base = st.booleans()
    elif field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        base = st.floats(allow_nan=True, allow_infinity=True, width=64 if field.type == F.TYPE_DOUBLE else 32)
    elif field.type == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        base = st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    else:
        base = _small_ints(*_INT_RANGES[field.type])
    return base


def message(descriptor: Descriptor, hints: dict[str, st.SearchStrategy] | None = None,
            depth: int = 0, plausible: bool = False) -> st.SearchStrategy:
    """Messages of ``descriptor`` with any subset of fields set (recursively, to MAX_DEPTH).

    ``plausible``: every hinted field is set, from its hint only (the request reaches past validation),
    the others are drawn as usual.
    """
    hints = hints or {}
    cls = GetMessageClass(descriptor)
    required: dict[str, st.SearchStrategy] = {}
    setters: dict[str, st.SearchStrategy] = {}
    for field in descriptor.fields:
        if plausible and field.name in hints:
            required[field.name] = hints[field.name]
            continue
        strategy = _field(field, hints, depth)
        if strategy is not None:
            setters[field.name] = strategy
    return st.fixed_dictionaries(required, optional=setters).map(lambda values: _build(cls, descriptor, values))


def _field(field: FieldDescriptor, hints, depth: int) -> st.SearchStrategy | None:
    """Any value of ``field`` (a hint, for the whole field, joins the choices)."""
    drawn = _any_value(field, hints, depth)
    hint = hints.get(field.name)
    if hint is None:
        return drawn
    return hint if drawn is None else st.one_of(hint, drawn)


def _any_value(field: FieldDescriptor, hints, depth: int) -> st.SearchStrategy | None:
    if field.type == F.TYPE_MESSAGE:
        if field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.type == F.TYPE_MESSAGE:
                return None
            return st.dictionaries(_scalar(field.message_type.fields_by_name["key"]), _scalar(value_field),
                                   max_size=3)
        if depth >= MAX_DEPTH:
            return None
        one = message(field.message_type, hints, depth + 1)
    else:
        one = _scalar(field)
    if field.is_repeated:
        return st.lists(one, max_size=5)
    return one


def _build(cls: Callable[[], Any], descriptor: Descriptor, values: dict[str, Any]):
    msg = cls()
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        target = getattr(msg, name) if field.type == F.TYPE_MESSAGE or field.is_repeated else None
        if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            target.update(value)
        elif field.is_repeated:
            if field.type == F.TYPE_MESSAGE:
                for item in value:
                    target.add().CopyFrom(item)
            else:
                target.extend(value)
        elif field.type == F.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg
