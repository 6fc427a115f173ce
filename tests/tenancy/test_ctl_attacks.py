"""Control-plane attacks, each with a positive control: revoked keys on open streams, stats for another
node's engines, ListNodes by a tenant, tenant Redis users listing or flushing, a re-created tenant
inheriting blocks, a node key exhausting the slot table, and proof that a tenant's map is read and
written through that tenant's own Redis user."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis.asyncio as aioredis
import redis.exceptions

from kvmesh.namespace import Namespace
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, tenant_admin_pb2 as tpb

from tests.tenancy.test_isolation import TOKENS, expect, hashes, ns_pb, publish_as_node

REPLICA_REACTION_S = 1.0  # the replica's XREAD block (control_plane.replica.BLOCK_MS) plus its first retries


def stored(node_id, inc, seq, tenant, hs):
    return pb.EventBatch(node_id=node_id, incarnation=inc, seq=seq, namespace=ns_pb(tenant), events=[
        pb.KvEvent(stored=pb.BlockStored(block_hashes=hs, block_size=32, medium=common_pb2.MEDIUM_CPU))])


async def test_a_key_revoked_while_its_event_stream_is_open_is_refused_at_the_next_batch(fleet):
    await fleet.tenant("tenant-a")
    key_id, node_key = await fleet.key("node", node_id="node-a")
    cp = fleet.cp(node_key)
    inc = (await cp.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(
        node_id="node-a", data_plane_address="127.0.0.1:7001")))).incarnation
    queue: asyncio.Queue = asyncio.Queue()

    async def batches():
        while (batch := await queue.get()) is not None:
            yield batch

    stream = cp.StreamEvents(batches())
    await queue.put(stored("node-a", inc, 1, "tenant-a", hashes(2)))
    assert (await stream.read()).status == pb.ACK_STATUS_APPLIED  # positive control: the stream works
    await fleet.admin.RevokeKey(tpb.RevokeKeyRequest(key_id=key_id))
    await queue.put(stored("node-a", inc, 2, "tenant-a", hashes(4)[2:]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.read()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in info.value.details()
    _, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    found = await fleet.cp(sched).LookupPrefix(pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"),
                                                                      token_ids=TOKENS[:32 * 4]))
    assert found.holders[0].leading_blocks == 2  # the batch after revocation was not applied
    await queue.put(None)


async def test_a_key_revoked_while_its_lookup_stream_is_open_is_refused_at_the_next_lookup(fleet):
    await fleet.tenant("tenant-a")
    cp_node, _, batch = await publish_as_node(fleet, "node-a", "tenant-a", hashes(2))
    assert (await cp_node.PublishEvents(batch)).status == pb.ACK_STATUS_APPLIED
    key_id, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    _, other = await fleet.key("scheduler", tenant_id="tenant-a")
    lookup = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=TOKENS[:32 * 4])
    queue: asyncio.Queue = asyncio.Queue()

    async def lookups():
        while (request := await queue.get()) is not None:
            yield request

    stream = fleet.cp(sched).LookupPrefixStream(lookups())
    await queue.put(lookup)
    assert (await stream.read()).holders[0].leading_blocks == 2  # positive control: the stream answers
    await fleet.admin.RevokeKey(tpb.RevokeKeyRequest(key_id=key_id))
    await queue.put(lookup)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.read()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in info.value.details()
    await queue.put(None)
    # another key of the same tenant still streams: the refusal was the revocation
    (reply,) = [r async for r in fleet.cp(other).LookupPrefixStream(iter([lookup]))]
    assert reply.holders[0].leading_blocks == 2


async def test_a_key_revoked_while_its_lookup_batch_stream_is_open_is_refused_at_the_next_batch(fleet):
    await fleet.tenant("tenant-a")
    cp_node, _, batch = await publish_as_node(fleet, "node-a", "tenant-a", hashes(2))
    assert (await cp_node.PublishEvents(batch)).status == pb.ACK_STATUS_APPLIED
    key_id, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    _, other = await fleet.key("scheduler", tenant_id="tenant-a")
    lookups = pb.LookupPrefixBatch(lookups=[pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"),
                                                                   token_ids=TOKENS[:32 * 4])] * 2)
    queue: asyncio.Queue = asyncio.Queue()

    async def batches():
        while (request := await queue.get()) is not None:
            yield request

    stream = fleet.cp(sched).LookupPrefixBatches(batches())
    await queue.put(lookups)
    assert [a.holders[0].leading_blocks for a in (await stream.read()).answers] == [2, 2]  # positive control
    await fleet.admin.RevokeKey(tpb.RevokeKeyRequest(key_id=key_id))
    await queue.put(lookups)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.read()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in info.value.details()
    await queue.put(None)
    # another key of the same tenant still streams: the refusal was the revocation
    (reply,) = [r async for r in fleet.cp(other).LookupPrefixBatches(iter([lookups]))]
    assert [a.holders[0].leading_blocks for a in reply.answers] == [2, 2]


async def test_a_node_reports_stats_for_its_own_engines_only(fleet):
    _, node_key = await fleet.key("node", node_id="node-a")
    as_node = fleet.cp(node_key)
    await as_node.ReportStats(pb.ReportStatsRequest(engines=[  # positive control: its own engines
        pb.EngineSample(engine_id="node-a", prefill_tokens_per_s=1000.0),
        pb.EngineSample(engine_id="node-a:gpu1", prefill_tokens_per_s=1000.0)]))
    for victim in ("node-b", "node-b:gpu0", "node-ab"):
        await expect(as_node.ReportStats(pb.ReportStatsRequest(engines=[
            pb.EngineSample(engine_id=victim, prefill_tokens_per_s=1e9)])), grpc.StatusCode.PERMISSION_DENIED,
            "its own engines")


async def test_a_node_cannot_report_for_a_registered_node_its_id_prefixes(fleet):
    """Found in review: node ids may hold ':', and an engine id "<node>:<name>" counted as that node's: node "rack1"'s
    key reported figures for "rack1:gpu0", the engine (and id) of the registered node "rack1:gpu0", and steered every
    tenant's routing towards it or away. An engine id that names a longer registered node is that node's now.
    Control: "rack1" still reports its own "rack1:gpu1", and "rack1:gpu0" its own."""
    _, short_key = await fleet.key("node", node_id="rack1")
    _, long_key = await fleet.key("node", node_id="rack1:gpu0")
    await fleet.cp(long_key).RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(
        node_id="rack1:gpu0", data_plane_address="127.0.0.1:7001")))
    await expect(fleet.cp(short_key).ReportStats(pb.ReportStatsRequest(engines=[
        pb.EngineSample(engine_id="rack1:gpu0", prefill_tokens_per_s=1e9)])), grpc.StatusCode.PERMISSION_DENIED,
        "names no other registered node")
    await fleet.cp(short_key).ReportStats(pb.ReportStatsRequest(engines=[
        pb.EngineSample(engine_id="rack1:gpu1", prefill_tokens_per_s=1000.0)]))
    await fleet.cp(long_key).ReportStats(pb.ReportStatsRequest(engines=[
        pb.EngineSample(engine_id="rack1:gpu0", prefill_tokens_per_s=1000.0)]))


async def test_list_nodes_is_not_open_to_tenant_schedulers(fleet):
    await fleet.tenant("tenant-a")
    await publish_as_node(fleet, "node-a", "tenant-a", hashes(1))
    _, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    await expect(fleet.cp(sched).ListNodes(pb.ListNodesRequest()), grpc.StatusCode.PERMISSION_DENIED)
    _, node_key = await fleet.key("node", node_id="node-x")
    nodes = (await fleet.cp(node_key).ListNodes(pb.ListNodesRequest())).nodes  # positive control: nodes may
    assert any(n.node.node_id == "node-a" for n in nodes)


async def _tenant_client(control_plane, redis_server, tenant):
    user, password, epoch = await control_plane.core.tenants.redis_credentials(tenant)
    return aioredis.Redis.from_url(redis_server.url, username=user, password=password), epoch


async def test_tenant_redis_users_cannot_list_key_names_or_flush_scripts(fleet, control_plane, redis_server):
    await fleet.tenant("tenant-a")
    await fleet.tenant("tenant-b")
    cp_a, _, batch = await publish_as_node(fleet, "node-a", "tenant-a", hashes())
    await cp_a.PublishEvents(batch)
    admin = control_plane.core.block_map._redis
    a_key = control_plane.core.block_map._keys.blocks(
        Namespace.from_proto(ns_pb("tenant-a")), (await control_plane.core.tenants.get_tenant("tenant-a")).epoch)
    assert await admin.hlen(a_key) == 8  # positive control: tenant A's key names are there to be listed
    as_b, b_epoch = await _tenant_client(control_plane, redis_server, "tenant-b")
    try:
        for attempt in (as_b.scan(0, count=1000), as_b.keys("*"), as_b.randomkey(), as_b.dbsize(),
                        as_b.script_flush(), as_b.execute_command("FUNCTION", "FLUSH"), as_b.flushall(),
                        as_b.info(), as_b.execute_command("CLIENT", "LIST"), as_b.publish("x", "y"),
                        as_b.eval("return redis.call('SCAN', 0)", 0)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await attempt
        b_key = control_plane.core.block_map._keys.blocks(Namespace.from_proto(ns_pb("tenant-b")), b_epoch)
        assert await as_b.hgetall(b_key) == {}  # positive control: its own keys answer
    finally:
        await as_b.aclose()
    assert await admin.hlen(a_key) == 8


async def test_a_deleted_and_recreated_tenant_does_not_inherit_the_old_blocks(fleet, control_plane):
    await fleet.tenant("tenant-a")
    cp_a, reg, batch = await publish_as_node(fleet, "node-a", "tenant-a", hashes())
    await cp_a.PublishEvents(batch)
    old_epoch = (await control_plane.core.tenants.get_tenant("tenant-a")).epoch
    old_key = control_plane.core.block_map._keys.blocks(Namespace.from_proto(ns_pb("tenant-a")), old_epoch)
    admin = control_plane.core.block_map._redis
    old_map = await admin.hgetall(old_key)
    assert len(old_map) == 8
    lookup = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=TOKENS)
    assert (await fleet.admin_cp.LookupPrefix(lookup)).holders[0].leading_blocks == 8  # positive control
    await fleet.admin.DeleteTenant(tpb.DeleteTenantRequest(tenant_id="tenant-a"))
    assert not await admin.exists(old_key)  # purged on delete
    await fleet.tenant("tenant-a")
    assert (await control_plane.core.tenants.get_tenant("tenant-a")).epoch != old_epoch
    await admin.hset(old_key, mapping=old_map)  # a late write or a missed purge under the old epoch ...
    _, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    assert not (await fleet.cp(sched).LookupPrefix(lookup)).holders  # ... is never read by the new tenant
    assert not (await fleet.admin_cp.LookupPrefix(lookup)).holders


async def test_one_node_key_cannot_exhaust_the_slot_table(fleet, control_plane):
    _, attacker = await fleet.key("node", node_id="node-evil")
    as_attacker = fleet.cp(attacker)
    register = pb.RegisterNodeRequest(node=pb.NodeInfo(node_id="node-evil", data_plane_address="127.0.0.1:1"))
    refused = 0
    for _ in range(40):
        try:
            await as_attacker.RegisterNode(register)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "too often" in exc.details()
            refused += 1
    assert refused == 40 - 17  # the first registration plus 16 re-registrations, then refused
    _, honest = await fleet.key("node", node_id="node-ok")
    assert (await fleet.cp(honest).RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(
        node_id="node-ok", data_plane_address="127.0.0.1:2")))).incarnation >= 1  # others still get slots
    await control_plane.core.block_map.collect_garbage()
    await as_attacker.RegisterNode(register)  # after the sweep the node may re-register again


async def test_the_tenant_map_is_read_and_written_through_the_tenant_redis_user(fleet, control_plane, redis_server):
    await fleet.tenant("tenant-a")
    cp_a, _, batch = await publish_as_node(fleet, "node-a", "tenant-a", hashes())
    await cp_a.PublishEvents(batch)
    _, sched = await fleet.key("scheduler", tenant_id="tenant-a")
    lookup = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=TOKENS)
    assert (await fleet.cp(sched).LookupPrefix(lookup)).holders[0].leading_blocks == 8  # positive control
    admin = control_plane.core.block_map._redis
    user = (await control_plane.core.tenants.get_tenant("tenant-a")).redis_user
    clients = (await admin.execute_command("CLIENT", "LIST")).decode() if isinstance(
        await admin.execute_command("CLIENT", "LIST"), bytes) else await admin.execute_command("CLIENT", "LIST")
    assert f"user={user} " in str(clients)  # the control plane holds a connection as the tenant user
    # Take the tenant user's rights away in Redis: the control plane must fail, not fall back to its own user.
    await admin.execute_command("ACL", "SETUSER", user, "-@all", "+auth", "+hello", "+ping")
    try:
        # Lookups answer from the in-memory replica, which reads the map as the tenant user too: its follower's
        # next read (within its XREAD block, 1 s) is refused, the namespace leaves sync, and lookups go to Redis
        # as the tenant user again, and are refused. Never answered through the control plane's own user.
        deadline = time.monotonic() + 2 * REPLICA_REACTION_S
        while time.monotonic() < deadline:
            try:
                await fleet.cp(sched).LookupPrefix(lookup)
            except grpc.aio.AioRpcError:
                break
            await asyncio.sleep(0.05)
        await expect(fleet.cp(sched).LookupPrefix(lookup), grpc.StatusCode.PERMISSION_DENIED, "denied access")
        batch.seq = 2
        await expect(cp_a.PublishEvents(batch), grpc.StatusCode.PERMISSION_DENIED, "denied access")
    finally:
        await control_plane.core.tenants.redis_credentials("tenant-a", refused_before=True)  # restore the rules
    assert (await fleet.cp(sched).LookupPrefix(lookup)).holders[0].leading_blocks == 8


async def test_route_answers_another_tenants_prefix_like_an_absent_one(fleet):
    await fleet.tenant("tenant-a")
    await fleet.tenant("tenant-b")
    cp_a, _, batch = await publish_as_node(fleet, "node-a", "tenant-a", hashes())
    await cp_a.PublishEvents(batch)
    _, a_key = await fleet.key("scheduler", tenant_id="tenant-a")
    _, b_key = await fleet.key("scheduler", tenant_id="tenant-b")

    def route(tenant, tokens):
        return pb.RouteRequest(namespace=ns_pb(tenant), token_ids=tokens, policy=pb.ROUTE_POLICY_AFFINITY,
                               candidates=[pb.EngineCandidate(engine_id="engine-a", node_id="node-a"),
                                           pb.EngineCandidate(engine_id="engine-z", node_id="node-z")])

    mine = await fleet.cp(a_key).Route(route("tenant-a", TOKENS))
    assert mine.engine_id == "engine-a" and mine.local_cached_tokens == 8 * 32  # positive control
    probe = await fleet.cp(b_key).Route(route("tenant-a", TOKENS))
    control = await fleet.cp(b_key).Route(route("tenant-a", [t + 1 for t in TOKENS]))
    assert probe.local_cached_tokens == control.local_cached_tokens == 0
    assert not probe.HasField("kv_source") and probe.engine_id == control.engine_id
    assert probe.reason == control.reason and probe.source_decision == control.source_decision
