"""Oversized requests from a key holder are refused before the control plane reads them (found by the black-box
judge, tests/security/blackbox_probe.py).

Every repeated field of a request is counted against its limit before one entry becomes a Python object:

* 1,000,000 empty ("cleared") events in one 4 MiB ``PublishEvents`` used to be turned into a million objects on
  the event loop (~3 s; 16M of them in a 64 MiB message ~50 s, every other RPC of the control plane waiting) and
  were then accepted, since no event count was checked;
* token ids beyond ``max_lookup_tokens`` (a namespace of 4,096-token blocks passed the block count with 16M of
  them, ~700 MB of Python ints) are refused by count.

Positive controls: a batch of one clear and a lookup of the limit's token ids are served.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb


@pytest.fixture
def cp_config(redis_server, key_prefix, admin_key):
    from control_plane.config import ControlPlaneConfig

    return ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=key_prefix,
                              lease_ms=60_000, admin_key=admin_key, policy_ttl_s=0, max_lookup_tokens=65_536)


async def _registered(fleet, tenant: str) -> tuple[pb.RegisterNodeResponse, object]:
    await fleet.tenant(tenant)
    _, key = await fleet.key("node", node_id="n1")
    cp = fleet.cp(key)
    reg = await cp.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(node_id="n1",
                                                                        data_plane_address="127.0.0.1:1")))
    return reg, cp


async def test_a_batch_of_a_million_empty_events_is_refused_before_it_is_read(fleet):
    reg, cp = await _registered(fleet, "t1")
    ns = Namespace("t1", "m", "r", CacheConfig(block_size=32)).to_proto()
    clear = pb.KvEvent(cleared=pb.AllBlocksCleared())
    one = pb.EventBatch(node_id="n1", incarnation=reg.incarnation, seq=reg.next_seq, namespace=ns, events=[clear])
    assert (await cp.PublishEvents(one, timeout=10)).status == pb.ACK_STATUS_APPLIED  # positive control
    flood = pb.EventBatch(node_id="n1", incarnation=reg.incarnation, seq=reg.next_seq + 1, namespace=ns)
    flood.events.extend([clear] * 1_000_000)
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await cp.PublishEvents(flood, timeout=60)
    took = time.monotonic() - start
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "1000000 events in one request; the limit is 65552" in refused.value.details()
    assert took < 1.5, f"refusing the flood took {took:.1f} s"  # on the code before: ~3 s, then accepted


async def test_token_ids_beyond_max_lookup_tokens_are_refused_by_count(fleet):
    _, cp = await _registered(fleet, "t2")
    ns = Namespace("t2", "m", "r", CacheConfig(block_size=4096)).to_proto()  # 16 blocks pass max_lookup_blocks
    limit = 65_536
    served = await cp.LookupPrefix(pb.LookupPrefixRequest(namespace=ns, token_ids=range(limit)), timeout=30)
    assert served.blocks_queried == limit // 4096  # positive control: the limit itself is served
    over = list(range(limit + 1))
    calls = {
        "LookupPrefix": cp.LookupPrefix(pb.LookupPrefixRequest(namespace=ns, token_ids=over), timeout=30),
        "Route": cp.Route(pb.RouteRequest(namespace=ns, token_ids=over, candidates=[
            pb.EngineCandidate(engine_id="n1", node_id="n1")]), timeout=30),
    }
    for method, call in calls.items():
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, refused.value.details())
        assert f"{limit + 1} token ids in one request; the limit is {limit}" in refused.value.details(), method
    assert (await asyncio.wait_for(cp.Ping(common_pb2.PingRequest()), 5)) is not None


async def test_a_batch_of_many_clears_is_refused_before_any_sweep(fleet):
    """Each clear of one tier sweeps every namespace the node holds blocks in (Redis scripts): 65,536 of them in
    one 256 KiB batch kept the control plane (and Redis) sweeping for minutes. A batch may clear 16 times."""
    reg, cp = await _registered(fleet, "t3")
    ns = Namespace("t3", "m", "r", CacheConfig(block_size=32)).to_proto()
    clear_cpu = pb.KvEvent(cleared=pb.AllBlocksCleared(medium=common_pb2.MEDIUM_CPU))
    few = pb.EventBatch(node_id="n1", incarnation=reg.incarnation, seq=reg.next_seq, namespace=ns,
                        events=[clear_cpu] * 16)
    assert (await cp.PublishEvents(few, timeout=30)).status == pb.ACK_STATUS_APPLIED  # positive control
    many = pb.EventBatch(node_id="n1", incarnation=reg.incarnation, seq=reg.next_seq + 1, namespace=ns,
                         events=[clear_cpu] * 65_536)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await cp.PublishEvents(many, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "batch clears more than 16 times" in refused.value.details()


async def _redis_clients(redis_server) -> int:
    from kvmesh.redis_client import connect
    client = connect(redis_server.url)
    try:
        return int((await client.info("clients"))["connected_clients"])
    finally:
        await client.aclose()


async def test_lookups_of_many_namespaces_follow_a_bounded_number_of_them(fleet, control_plane, redis_server,
                                                                         monkeypatch):
    """Found by the black-box judge: the control plane's replica started following every namespace a lookup named,
    each with its own blocking Redis read, never stopping. 200 lookups of made-up models of one tenant (any key that
    may read it: its scheduler, a node its policy allows) held 200-400 more Redis connections, for good; Redis
    serves 10,000 clients at most, the whole fleet's. Now a lookup follows only a namespace that holds blocks, and at
    most MAX_FOLLOWED_NAMESPACES (shortened here); lookups of the others are answered from Redis, as before the
    replica. Positive control: namespaces beyond the bound that hold blocks are answered with their holder."""
    from control_plane import replica as replica_module
    monkeypatch.setattr(replica_module, "MAX_FOLLOWED_NAMESPACES", 8, raising=False)
    reg, cp = await _registered(fleet, "t4")
    replica = control_plane.core.block_map.replica
    followed = len(replica._namespaces)
    before = await _redis_clients(redis_server)
    for i in range(200):
        ns = Namespace("t4", f"made-up-model-{i}", "r", CacheConfig(block_size=32)).to_proto()
        await cp.LookupPrefix(pb.LookupPrefixRequest(namespace=ns, block_hashes=[bytes(32)]), timeout=10)
    await asyncio.sleep(1.5)  # every follower has started its read by now
    grew = await _redis_clients(redis_server) - before
    assert grew < 20, f"{grew} more Redis connections after lookups of 200 namespaces"
    assert len(replica._namespaces) == followed
    block = bytes(range(32))
    stored = pb.KvEvent(stored=pb.BlockStored(block_hashes=[block], block_size=32, medium=common_pb2.MEDIUM_CPU))
    for i in range(12):  # namespaces that hold blocks: followed up to the bound, answered either way
        real = Namespace("t4", f"real-model-{i}", "r", CacheConfig(block_size=32)).to_proto()
        await cp.PublishEvents(pb.EventBatch(node_id="n1", incarnation=reg.incarnation, seq=reg.next_seq + i,
                                             namespace=real, events=[stored]), timeout=10)
        found = await cp.LookupPrefix(pb.LookupPrefixRequest(namespace=real, block_hashes=[block]), timeout=10)
        assert [(h.node_id, h.leading_blocks) for h in found.holders] == [("n1", 1)]
    assert len(replica._namespaces) <= 8


async def test_lookups_naming_made_up_tenants_grow_no_cache_without_bound(fleet, control_plane):
    """Found by the black-box judge: every tenant id a request named (existing or not) stayed in the control plane's
    policy cache for good. Now at most MAX_CACHED_TENANTS. Positive control: the real tenant is still served."""
    from tenancy.authz import MAX_CACHED_TENANTS
    reg, cp = await _registered(fleet, "t5")
    cache = control_plane.core.authz._cache
    for i in range(MAX_CACHED_TENANTS + 200):
        ns = Namespace(f"made-up-{i}", "m", "r", CacheConfig(block_size=32)).to_proto()
        reply = await cp.LookupPrefix(pb.LookupPrefixRequest(namespace=ns, block_hashes=[bytes(32)]), timeout=10)
        assert not reply.holders
    assert len(cache) <= MAX_CACHED_TENANTS, f"{len(cache)} tenant ids cached"
    assert (await cp.GetTenantLimits(pb.GetTenantLimitsRequest(tenant="t5"), timeout=10)).tenant_epoch


async def test_made_up_engine_names_fill_no_more_than_the_figures_table(fleet, control_plane, monkeypatch):
    """Found by the black-box judge: a node may report its own engines, ``<node>`` or ``<node>:<anything>``, and
    every new name became a field of a Redis hash that every replica reads whole (HGETALL) to route; a node key
    making names up grew both without bound. Now a hash keeps MAX_FIGURES entries (shortened here); past that a new
    name is dropped while known ones keep folding (positive control)."""
    from control_plane.routing import stats
    monkeypatch.setattr(stats, "MAX_FIGURES", 100, raising=False)
    _, cp = await _registered(fleet, "t6")
    await cp.ReportStats(pb.ReportStatsRequest(engines=[pb.EngineSample(engine_id="n1", prefill_tokens_per_s=100.0)]))
    for round_ in range(3):
        await cp.ReportStats(pb.ReportStatsRequest(engines=[
            pb.EngineSample(engine_id=f"n1:made-up-{round_}-{i}", prefill_tokens_per_s=1.0) for i in range(1000)]))
    await cp.ReportStats(pb.ReportStatsRequest(engines=[pb.EngineSample(engine_id="n1", prefill_tokens_per_s=200.0)]))
    store = control_plane.core.router._stats
    held = await store._redis.hgetall(store.engine_key)
    assert len(held) <= 100, f"{len(held)} engine figures held"
    assert 100.0 < float(held[b"n1"]) < 200.0  # the node's real engine still folds its samples


async def test_huge_ids_are_neither_stored_nor_echoed(fleet, control_plane, redis_server, key_prefix):
    """Found in review: a node key's GetTenantLimits of a 1 MiB made-up tenant id was looked up, cached by the
    authorizer (4,096 entries, any size: up to 64 GiB), audited twice over (as the target and inside the reason) and
    echoed in the error; a scheduler key's RevokeKey of a 1 MiB key id the same. Redis (every tenant's, no
    maxmemory in compose) grew ~32 MiB a second, and `kvmesh admin audit` failed past the 64 MiB send limit. Ids are
    now checked before they are used, and every audit field and refusal is cut to a few hundred characters.
    Control: the audit stream still says who was refused what."""
    import redis.asyncio as aioredis
    from kvmesh.v1 import tenant_admin_pb2 as tpb
    from tenancy.keys import TenantKeys
    await fleet.tenant("t1")
    _, node_key = await fleet.key("node", node_id="n1")
    _, scheduler_key = await fleet.key("scheduler", tenant_id="t1")
    for i in range(25):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await fleet.cp(node_key).GetTenantLimits(pb.GetTenantLimitsRequest(tenant=f"t{i}-" + "x" * (1 << 20)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(refused.value.details()) < 1_000, "the made-up id came back whole"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await fleet.tenant_admin(scheduler_key).RevokeKey(tpb.RevokeKeyRequest(key_id="k" * (1 << 20)))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and len(refused.value.details()) < 1_000
    assert max(map(len, control_plane.core.authz._cache), default=0) <= 63  # nothing made up was cached
    entries = (await fleet.admin.ListAudit(tpb.ListAuditRequest(limit=100))).entries
    assert max(len(e.target) + len(e.detail) for e in entries) < 2_000
    assert any(e.action == "denied:RevokeKey" and e.target.startswith("kkk") for e in entries)  # control
    redis = aioredis.from_url(redis_server.url)
    try:
        assert await redis.memory_usage(TenantKeys(key_prefix).audit) < 1 << 20
    finally:
        await redis.aclose()
