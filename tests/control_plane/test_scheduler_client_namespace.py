"""How a custom scheduler names the engines' namespace: ``SchedulerClient.namespace_for`` (the connector's rule) or
the proto message; anything else is refused with a message that says what to pass (once ``AttributeError:
validate``). The end-to-end proof against real engines: tests/engine_connector/test_walkthrough.py."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.hashing import HashAlgo
from kvmesh.namespace import ENGINE_KV_LAYOUT, CacheConfig, Namespace

from control_plane.scheduler_client import SchedulerClient
from engine_connector.config import KV_LAYOUT


def test_namespace_for_follows_the_engines_rule():
    ns = SchedulerClient.namespace_for("/models/m", tenant="acme", block_size=32, kv_dtype="torch.bfloat16")
    assert ns == Namespace("acme", "/models/m", "", CacheConfig(
        block_size=32, kv_dtype="bfloat16", kv_layout=KV_LAYOUT, parallel_layout="tp1-pp1",
        hash_algo=HashAlgo.SHA256, hash_seed=""))
    assert KV_LAYOUT == ENGINE_KV_LAYOUT  # the connector's layout is the one schedulers name
    # The fields alone (no layout, kvmesh's own default hash) are another namespace: they never match.
    assert Namespace("acme", "/models/m", "", CacheConfig(block_size=32)).fingerprint != ns.fingerprint
    with pytest.raises(InvalidArgument, match="unknown hash algorithm 'md5'"):
        SchedulerClient.namespace_for("m", block_size=32, kv_dtype="bfloat16", hash_algo="md5")


async def test_the_proto_namespace_is_taken_and_anything_else_refused():
    ns = SchedulerClient.namespace_for("m", tenant="acme", block_size=32, kv_dtype="bfloat16")
    async with SchedulerClient("127.0.0.1:1", ns.to_proto()) as client:
        assert client.namespace == ns
    with pytest.raises(TypeError, match=r"namespace must be a kvmesh.namespace.Namespace \(SchedulerClient."
                                        r"namespace_for\) or a kvmesh.v1.Namespace message, not dict"):
        SchedulerClient("127.0.0.1:1", {"tenant": "acme"})
    bad = ns.to_proto()
    bad.tenant = "Not A Tenant"
    with pytest.raises(InvalidArgument, match="not a valid tenant id"):
        SchedulerClient("127.0.0.1:1", bad)
