"""The request digest a peer proof signs: long repeated fields, framed in one native call, give the same bytes as
framing value by value (the digest both ends compute must not depend on how long a field is)."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
from google.protobuf.descriptor import FieldDescriptor

from kvmesh import request_digest as rd
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import data_plane_pb2 as pb

NS = Namespace("t", "m", "r0", CacheConfig(block_size=16))
EDGES = [0, 1, -1, 2**31 - 1, -2**31, 2**63 - 1, -2**63]


def one_by_one(field, values) -> bytes:
    return b"".join(map(rd._encoder(field), values))


@pytest.mark.parametrize("kind", ["INT32", "INT64", "SINT32", "SINT64", "SFIXED32", "SFIXED64", "ENUM"])
def test_signed_integers_frame_as_one_by_one(kind):
    field = SimpleNamespace(type=getattr(FieldDescriptor, f"TYPE_{kind}"))
    values = EDGES * 3 + [random.randint(-2**63, 2**63 - 1) for _ in range(100)]
    assert rd._repeated(field, values) == one_by_one(field, values)


@pytest.mark.parametrize("kind", ["UINT32", "UINT64", "FIXED32", "FIXED64"])
def test_unsigned_integers_frame_as_one_by_one(kind):
    field = SimpleNamespace(type=getattr(FieldDescriptor, f"TYPE_{kind}"))
    values = [0, 1, 2**63, 2**64 - 1] * 5 + [random.getrandbits(64) for _ in range(100)]
    assert rd._repeated(field, values) == one_by_one(field, values)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 1024])
def test_a_pull_request_digests_as_framed_value_by_value(monkeypatch, n):
    hashes = [os.urandom(32) for _ in range(n)]
    uneven = [os.urandom(31 + i % 2) for i in range(n)]  # lengths differ: framed one by one
    requests = [pb.LookupRequest(namespace=NS.to_proto(), block_hashes=hashes, lease_id="l",
                                 landing_addrs=[random.getrandbits(64) for _ in range(n)]),
                pb.LookupRequest(namespace=NS.to_proto(), block_hashes=uneven)]
    fast = [rd.request_digest(r) for r in requests]
    monkeypatch.setattr(rd, "_repeated", one_by_one)
    assert fast == [rd.request_digest(r) for r in requests]
    # negative control: one hash changed changes the digest
    if n:
        hashes[-1] = bytes(32)
        assert rd.request_digest(pb.LookupRequest(namespace=NS.to_proto(), block_hashes=hashes, lease_id="l",
                                                  landing_addrs=requests[0].landing_addrs)) != fast[0]
