"""Isolation that holds when probed: real control plane, real Redis, real tenant ACL users."""

from __future__ import annotations

import grpc
import pytest
import redis.asyncio as aioredis
import redis.exceptions

from kvmesh.hashing import BlockHasher
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, tenant_admin_pb2 as tpb
from tenancy.peer_proof import NodeIdentity

PEER_KEY = NodeIdentity().public_key  # the consumer node's peer key, bound into its grants

TOKENS = list(range(300, 300 + 32 * 8))


def ns_pb(tenant):
    return common_pb2.Namespace(tenant=tenant, model="tiny-llama", weight_version="v1",
                                cache_config=common_pb2.CacheConfig(block_size=32))


def hashes(n=8):
    return BlockHasher().block_hashes(TOKENS[:32 * n], 32)


async def expect(coro, code, text=""):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details()


async def publish_as_node(fleet, node_id, tenant, hs, node_key=None):
    _, key = (None, node_key) if node_key else await fleet.key("node", node_id=node_id)
    cp = fleet.cp(key)
    reg = await cp.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(node_id=node_id,
                                                                        data_plane_address="127.0.0.1:7001")))
    batch = pb.EventBatch(node_id=node_id, incarnation=reg.incarnation, seq=1, namespace=ns_pb(tenant), events=[
        pb.KvEvent(stored=pb.BlockStored(block_hashes=hs, block_size=32, medium=common_pb2.MEDIUM_CPU))])
    return cp, reg, batch


async def a_prefix_of_tenant_a(fleet) -> tuple[str, str]:
    """Tenants A and B; node-a holds 8 blocks of TOKENS in A's namespace. The two tenants' scheduler keys."""
    await fleet.tenant("tenant-a")
    await fleet.tenant("tenant-b")
    cp_a, _, batch = await publish_as_node(fleet, "node-a", "tenant-a", hashes())
    assert (await cp_a.PublishEvents(batch)).status == pb.ACK_STATUS_APPLIED
    _, a_key = await fleet.key("scheduler", tenant_id="tenant-a")
    _, b_key = await fleet.key("scheduler", tenant_id="tenant-b")
    return a_key, b_key


async def test_tenant_b_cannot_learn_whether_tenant_a_holds_a_prefix(fleet):
    a_key, b_key = await a_prefix_of_tenant_a(fleet)
    held = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=TOKENS)
    absent = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=[t + 1 for t in TOKENS])
    assert (await fleet.cp(a_key).LookupPrefix(held)).holders[0].leading_blocks == 8
    as_b = fleet.cp(b_key)
    probe, control = await as_b.LookupPrefix(held), await as_b.LookupPrefix(absent)
    assert not probe.holders and not control.holders
    assert probe.blocks_queried == control.blocks_queried == 8
    assert probe.ListFields() and [f.name for f, _ in probe.ListFields()] == [f.name for f, _ in control.ListFields()]
    # the same tokens in tenant B's own namespace are different keys: nothing there either
    assert not (await as_b.LookupPrefix(pb.LookupPrefixRequest(namespace=ns_pb("tenant-b"), token_ids=TOKENS))).holders


async def test_tenant_b_cannot_learn_whether_tenant_a_holds_a_prefix_over_a_lookup_stream(fleet):
    a_key, b_key = await a_prefix_of_tenant_a(fleet)
    held = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=TOKENS)
    absent = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=[t + 1 for t in TOKENS])
    own = pb.LookupPrefixRequest(namespace=ns_pb("tenant-b"), token_ids=TOKENS)
    # positive control: tenant A's scheduler finds its prefix on the stream
    (found,) = [r async for r in fleet.cp(a_key).LookupPrefixStream(iter([held]))]
    assert found.holders[0].leading_blocks == 8 and found.holders[0].node_id == "node-a"
    probe, control, mine = [r async for r in fleet.cp(b_key).LookupPrefixStream(iter([held, absent, own]))]
    assert not probe.holders and not control.holders and not mine.holders
    assert probe.blocks_queried == control.blocks_queried == 8  # the probe of A's prefix looks like a miss
    assert [f.name for f, _ in probe.ListFields()] == [f.name for f, _ in control.ListFields()]


async def test_tenant_b_cannot_learn_whether_tenant_a_holds_a_prefix_in_a_lookup_batch(fleet):
    a_key, b_key = await a_prefix_of_tenant_a(fleet)
    held = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=TOKENS)
    absent = pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=[t + 1 for t in TOKENS])
    own = pb.LookupPrefixRequest(namespace=ns_pb("tenant-b"), token_ids=TOKENS)
    # positive control: tenant A's scheduler finds its prefix in a batch
    (found,) = [r async for r in fleet.cp(a_key).LookupPrefixBatches(iter([pb.LookupPrefixBatch(lookups=[held])]))]
    assert found.answers[0].holders[0].leading_blocks == 8 and found.answers[0].holders[0].node_id == "node-a"
    (reply,) = [r async for r in fleet.cp(b_key).LookupPrefixBatches(
        iter([pb.LookupPrefixBatch(lookups=[held, absent, own])]))]
    probe, control, mine = reply.answers
    assert not probe.holders and not control.holders and not mine.holders
    assert probe.blocks_queried == control.blocks_queried == 8  # the probe of A's prefix looks like a miss
    assert [f.name for f, _ in probe.ListFields()] == [f.name for f, _ in control.ListFields()]


async def test_identical_tokens_in_two_tenants_never_share_a_key(control_plane):
    from kvmesh.redis_keys import Keys

    a = Namespace("tenant-a", "m", "v1", CacheConfig(32))
    b = Namespace("tenant-b", "m", "v1", CacheConfig(32))
    keys = Keys()
    assert keys.blocks(a) != keys.blocks(b)
    assert keys.blocks(a).startswith(keys.tenant_prefix("tenant-a"))
    assert not keys.blocks(b).startswith(keys.tenant_prefix("tenant-a"))


async def test_tenant_b_cannot_get_a_grant_to_pull_tenant_a_blocks(fleet):
    await fleet.tenant("tenant-a", allowed_nodes=["node-a"])
    await fleet.tenant("tenant-b", allowed_nodes=["node-b"])
    cp_a, _, batch = await publish_as_node(fleet, "node-a", "tenant-a", hashes())
    await cp_a.PublishEvents(batch)
    _, b_node_key = await fleet.key("node", node_id="node-b")
    as_b_node = fleet.cp(b_node_key)
    await expect(as_b_node.IssuePullGrant(pb.IssuePullGrantRequest(namespace=ns_pb("tenant-a"),
                                                                   source_node_id="node-a",
                                                                   consumer_public_key=PEER_KEY)),
                 grpc.StatusCode.PERMISSION_DENIED, "no pull grant")
    # ... while node-b may get grants for its own tenant from an allowed source
    await fleet.admin.SetPolicy(tpb.SetPolicyRequest(tenant_id="tenant-b", policy=tpb.TenantPolicy(
        allowed_nodes=["node-b", "node-c"])))
    grant = await as_b_node.IssuePullGrant(pb.IssuePullGrantRequest(namespace=ns_pb("tenant-b"),
                                                                    source_node_id="node-c",
                                                                    consumer_public_key=PEER_KEY))
    assert grant.token and grant.expires_unix_ms > 0
    # schedulers never get grants: the consumer node asks with its own key
    _, sched = await fleet.key("scheduler", tenant_id="tenant-b")
    await expect(fleet.cp(sched).IssuePullGrant(pb.IssuePullGrantRequest(namespace=ns_pb("tenant-b"),
                                                                         source_node_id="node-c",
                                                                    consumer_public_key=PEER_KEY)),
                 grpc.StatusCode.PERMISSION_DENIED)


async def test_tenant_b_cannot_read_tenant_a_keys_through_its_redis_user(fleet, control_plane, redis_server):
    await fleet.tenant("tenant-a")
    await fleet.tenant("tenant-b")
    cp_a, _, batch = await publish_as_node(fleet, "node-a", "tenant-a", hashes())
    await cp_a.PublishEvents(batch)
    store = control_plane.core.tenants
    b_user, b_password, b_epoch = await store.redis_credentials("tenant-b")
    a_epoch = (await store.get_tenant("tenant-a")).epoch
    a_key = control_plane.core.block_map._keys.blocks(Namespace.from_proto(ns_pb("tenant-a")), a_epoch)
    as_b = aioredis.Redis.from_url(redis_server.url, username=b_user, password=b_password)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            await as_b.hgetall(a_key)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await as_b.hset(a_key, "x", "y")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await as_b.keys("*")
        b_key = control_plane.core.block_map._keys.blocks(Namespace.from_proto(ns_pb("tenant-b")), b_epoch)
        assert await as_b.hgetall(b_key) == {}  # its own prefix is fine
    finally:
        await as_b.aclose()


async def test_a_node_outside_the_tenant_policy_is_refused_and_never_listed(fleet):
    await fleet.tenant("tenant-a", allowed_nodes=["node-a"])
    cp_x, _, batch = await publish_as_node(fleet, "node-x", "tenant-a", hashes())
    await expect(cp_x.PublishEvents(batch), grpc.StatusCode.PERMISSION_DENIED, "does not allow node 'node-x'")

    async def requests():
        yield batch

    acks = [a async for a in cp_x.StreamEvents(requests())]
    assert acks[0].status == pb.ACK_STATUS_REFUSED and "PERMISSION_DENIED" in acks[0].detail
    reply = await fleet.admin_cp.LookupPrefix(pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), token_ids=TOKENS))
    assert not reply.holders


async def test_shared_namespace_is_opt_in(fleet):
    await fleet.tenant("public", shared_with=["tenant-b"])
    await fleet.tenant("tenant-b")
    await fleet.tenant("tenant-c")
    cp, _, batch = await publish_as_node(fleet, "node-a", "public", hashes())
    await cp.PublishEvents(batch)
    query = pb.LookupPrefixRequest(namespace=ns_pb("public"), token_ids=TOKENS)
    _, b = await fleet.key("scheduler", tenant_id="tenant-b")
    _, c = await fleet.key("scheduler", tenant_id="tenant-c")
    assert (await fleet.cp(b).LookupPrefix(query)).holders[0].node_id == "node-a"
    assert not (await fleet.cp(c).LookupPrefix(query)).holders


async def test_quota_breach_is_resource_exhausted_and_loses_nothing(fleet):
    await fleet.tenant("tenant-a", max_index_entries=10, allowed_nodes=["node-a"])  # its sole node: all 10 its own
    hs = BlockHasher().block_hashes(list(range(32 * 14)), 32)
    cp, reg, batch = await publish_as_node(fleet, "node-a", "tenant-a", hs[:8])
    assert (await cp.PublishEvents(batch)).status == pb.ACK_STATUS_APPLIED
    again = pb.EventBatch(node_id="node-a", incarnation=reg.incarnation, seq=2, namespace=ns_pb("tenant-a"), events=[
        pb.KvEvent(stored=pb.BlockStored(block_hashes=hs[:8], block_size=32, medium=common_pb2.MEDIUM_GPU))])
    assert (await cp.PublishEvents(again)).status == pb.ACK_STATUS_APPLIED  # no new entries: within quota
    over = pb.EventBatch(node_id="node-a", incarnation=reg.incarnation, seq=3, namespace=ns_pb("tenant-a"), events=[
        pb.KvEvent(stored=pb.BlockStored(block_hashes=hs, block_size=32, medium=common_pb2.MEDIUM_CPU))])
    await expect(cp.PublishEvents(over), grpc.StatusCode.RESOURCE_EXHAUSTED, "quota of 10 index entries")
    reply = await fleet.admin_cp.LookupPrefix(pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"), block_hashes=hs))
    assert reply.holders[0].leading_blocks == 8  # everything stored before is still there

    async def stream():
        yield over

    (ack,) = [a async for a in cp.StreamEvents(stream())]
    assert ack.status == pb.ACK_STATUS_REFUSED and "RESOURCE_EXHAUSTED" in ack.detail
    tenant = await fleet.admin.GetTenant(tpb.GetTenantRequest(tenant_id="tenant-a"))
    assert tenant.index_entries == 8


async def test_one_node_cannot_fill_its_tenants_index_quota_for_the_others(fleet):
    """One node's key (the tenant allows every node, the default) published made-up blocks up to the tenant's
    max_index_entries, and every other node's batches of the tenant were then refused (RESOURCE_EXHAUSTED) for as
    long as it liked. Now one node holds at most half of the quota, counted per node and tenant in Redis."""
    await fleet.tenant("tenant-a", max_index_entries=10)
    made_up = BlockHasher().block_hashes(list(range(10_000, 10_000 + 32 * 10)), 32)
    cp_x, reg_x, flood = await publish_as_node(fleet, "node-x", "tenant-a", made_up)

    def batch(seq, *events):
        return pb.EventBatch(node_id="node-x", incarnation=reg_x.incarnation, seq=seq, namespace=ns_pb("tenant-a"),
                             events=list(events))

    await expect(cp_x.PublishEvents(flood), grpc.StatusCode.RESOURCE_EXHAUSTED, "at most half of the tenant's quota")
    # (a unary batch refused consumes no seq)
    half = batch(1, pb.KvEvent(stored=pb.BlockStored(block_hashes=made_up[:5], block_size=32,
                                                     medium=common_pb2.MEDIUM_CPU)))
    assert (await cp_x.PublishEvents(half)).status == pb.ACK_STATUS_APPLIED
    one_more = batch(2, pb.KvEvent(stored=pb.BlockStored(block_hashes=made_up[5:6], block_size=32,
                                                         medium=common_pb2.MEDIUM_CPU)))
    await expect(cp_x.PublishEvents(one_more), grpc.StatusCode.RESOURCE_EXHAUSTED, "holds 5 of tenant 'tenant-a'")

    # The tenant's other node still indexes its blocks (red before: the quota was full of node-x's).
    cp_a, _, honest = await publish_as_node(fleet, "node-a", "tenant-a", hashes(5))
    assert (await cp_a.PublishEvents(honest)).status == pb.ACK_STATUS_APPLIED
    reply = await fleet.admin_cp.LookupPrefix(pb.LookupPrefixRequest(namespace=ns_pb("tenant-a"),
                                                                      block_hashes=hashes(5)))
    assert [(h.node_id, h.leading_blocks) for h in reply.holders] == [("node-a", 5)]

    # Blocks a node removes, or a tier it clears, give it room again; re-storing what it holds adds nothing.
    def stored(seq, blocks):
        return batch(seq, pb.KvEvent(stored=pb.BlockStored(block_hashes=blocks, block_size=32,
                                                           medium=common_pb2.MEDIUM_CPU)))

    removed = batch(2, pb.KvEvent(removed=pb.BlockRemoved(block_hashes=made_up[:2], medium=common_pb2.MEDIUM_CPU)))
    assert (await cp_x.PublishEvents(removed)).status == pb.ACK_STATUS_APPLIED
    assert (await cp_x.PublishEvents(stored(3, made_up[2:7]))).status == pb.ACK_STATUS_APPLIED  # 2 new
    await expect(cp_x.PublishEvents(stored(4, made_up[7:8])), grpc.StatusCode.RESOURCE_EXHAUSTED)  # full: 5 + 5
    cleared = batch(4, pb.KvEvent(cleared=pb.AllBlocksCleared(medium=common_pb2.MEDIUM_CPU)))
    assert (await cp_x.PublishEvents(cleared)).status == pb.ACK_STATUS_APPLIED
    assert (await cp_x.PublishEvents(stored(5, made_up[5:10]))).status == pb.ACK_STATUS_APPLIED
    tenant = await fleet.admin.GetTenant(tpb.GetTenantRequest(tenant_id="tenant-a"))
    assert tenant.index_entries == 10  # node-a's 5, node-x's last 5


async def test_a_node_key_cannot_steer_a_tenants_next_requests_with_its_routes(fleet):
    """Found in review: a Route records where it sent the prompt as a speculative GPU holding (for
    route_speculative_ttl_ms), so the tenant's back-to-back requests stay together. A node key may read, and so
    route, every tenant that allows it (the default): its routes of the tenant's prompts to an engine of its choosing
    drew the tenant's next requests there. A node key's routes are answered but not recorded now. Control: the
    tenant's own scheduler's routes are."""
    await fleet.tenant("tenant-a")
    _, node_key = await fleet.key("node", node_id="node-x")
    _, scheduler = await fleet.key("scheduler", tenant_id="tenant-a")

    async def route(key: str, tokens: list[int], *candidates: tuple[str, int]) -> str:
        reply = await fleet.cp(key).Route(pb.RouteRequest(
            namespace=ns_pb("tenant-a"), token_ids=tokens, policy=pb.ROUTE_POLICY_AFFINITY,
            candidates=[pb.EngineCandidate(engine_id=f"engine-{n}", node_id=f"node-{n}", waiting_requests=w)
                        for n, w in candidates]))
        return reply.engine_id

    assert await route(node_key, TOKENS, ("x", 0)) == "engine-x"  # the node key's route: answered
    assert await route(scheduler, TOKENS, ("x", 1), ("y", 0)) == "engine-y", \
        "the node key's route drew the tenant's request to its engine"  # red before: engine-x
    other = list(range(9_000, 9_000 + 32 * 8))  # control: the scheduler's own route keeps its next one together
    assert await route(scheduler, other, ("z", 0)) == "engine-z"
    assert await route(scheduler, other, ("z", 1), ("w", 0)) == "engine-z"


async def test_a_sharee_routes_as_itself_not_as_the_sharing_tenant(fleet):
    """Found in review: another tenant's scheduler that may read a namespace through ``shared_with`` routed in it
    as its tenant: its routes were recorded as the tenant's speculative holdings (steering the tenant's next
    requests), its made-up backlogs booked the ledger as the tenant's own pulls (every pull of the tenant's from
    that source, private namespaces too, RECOMPUTE_CHEAPER), and its prefetch orders ran against the tenant's
    share of the destination's prefetch cap. A sharee now routes as itself: answered, not recorded, booked as its
    own tenant, no prefetch order. Controls: the tenant's own scheduler gets all three."""
    await fleet.tenant("public", shared_with=["tenant-b"])
    await fleet.tenant("tenant-b")
    cp, _, batch = await publish_as_node(fleet, "node-a", "public", hashes())
    assert (await cp.PublishEvents(batch)).status == pb.ACK_STATUS_APPLIED
    await publish_as_node(fleet, "node-b", "public", [])  # registered and live: a prefetch destination
    _, owner = await fleet.key("scheduler", tenant_id="public")
    _, sharee = await fleet.key("scheduler", tenant_id="tenant-b")

    async def route(key: str, *candidates: tuple[str, int, int], policy=pb.ROUTE_POLICY_AFFINITY, kv=0):
        return await fleet.cp(key).Route(pb.RouteRequest(
            namespace=ns_pb("public"), token_ids=TOKENS, policy=policy, kv_bytes_per_token=kv,
            min_cached_token_delta=1,
            candidates=[pb.EngineCandidate(engine_id=f"engine-{n}", node_id=f"node-{n}", waiting_requests=w,
                                           running_tokens=r) for n, w, r in candidates]))

    assert (await route(sharee, ("x", 0, 0))).engine_id == "engine-x"  # answered
    assert (await route(owner, ("x", 1, 0), ("y", 0, 0))).engine_id == "engine-y", \
        "the sharee's route drew the tenant's request to its engine"  # red before: engine-x
    pulls = {"policy": pb.ROUTE_POLICY_LOAD_AWARE, "kv": 1_000}
    theirs = await route(sharee, ("b", 0, 0), **pulls)
    assert theirs.kv_source.node_id == "node-a" and not theirs.HasField("prefetch"), "a sharee got a prefetch order"
    mine = await route(owner, ("b", 0, 0), **pulls)
    assert mine.kv_source.node_id == "node-a" and mine.HasField("prefetch")  # control: the tenant's own
    for _ in range(3):  # the sharee books node-a's NIC with made-up backlogs
        assert (await route(sharee, ("m", 0, 2**62), **pulls)).kv_source.node_id == "node-a"
    after = await route(owner, ("c", 0, 0), **pulls)  # (engine-b holds the prompt now, speculatively)
    assert after.source_decision == pb.SOURCE_DECISION_PULL and after.estimate.transfer_ms < 1_000, \
        f"the sharee's bookings held the tenant's pulls: {after.estimate.transfer_ms:.0f} ms"
    own = await route(sharee, ("c", 0, 0), **pulls)  # control: its own bookings hold the sharee's next pull
    assert own.estimate.transfer_ms > 10_000 or own.source_decision != pb.SOURCE_DECISION_PULL


async def test_a_tenant_limited_to_a_pool_is_held_and_served_by_that_pool_only(fleet, control_plane, monkeypatch):
    """``allowed_pools``: nodes of the pool hold and serve the tenant's blocks, a node of another pool neither
    publishes them nor is answered as a holder or a grant source; narrowing the policy hides the pool's holders
    at once. The pools are listed once per ``policy_ttl_s``, not once per holder of every lookup."""
    await fleet.tenant("tenant-p", allowed_pools=["gold"])
    gold = [f"gold-{i}" for i in range(8)]
    for node_id in gold:
        _, key = await fleet.key("node", node_id=node_id, pool="gold")
        cp = fleet.cp(key)
        reg = await cp.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(
            node_id=node_id, data_plane_address="127.0.0.1:7001", pool="gold")))
        assert (await cp.PublishEvents(pb.EventBatch(node_id=node_id, incarnation=reg.incarnation, seq=1,
                                                     namespace=ns_pb("tenant-p"), events=[pb.KvEvent(
            stored=pb.BlockStored(block_hashes=hashes(), block_size=32, medium=common_pb2.MEDIUM_CPU))]))
                ).status == pb.ACK_STATUS_APPLIED
    _, silver_key = await fleet.key("node", node_id="silver-0", pool="silver")
    silver = fleet.cp(silver_key)
    reg = await silver.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(
        node_id="silver-0", data_plane_address="127.0.0.1:7002", pool="silver")))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await silver.PublishEvents(pb.EventBatch(node_id="silver-0", incarnation=reg.incarnation, seq=1,
                                                 namespace=ns_pb("tenant-p"), events=[pb.KvEvent(
            stored=pb.BlockStored(block_hashes=hashes(), block_size=32, medium=common_pb2.MEDIUM_CPU))]))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    _, sched = await fleet.key("scheduler", tenant_id="tenant-p")
    lookup = pb.LookupPrefixRequest(namespace=ns_pb("tenant-p"), token_ids=TOKENS)

    listings = 0
    list_nodes = control_plane.core.block_map.list_nodes

    async def counted():
        nonlocal listings
        listings += 1
        return await list_nodes()

    monkeypatch.setattr(control_plane.core.block_map, "list_nodes", counted)
    monkeypatch.setattr(control_plane.core, "config", control_plane.core.config.model_copy(
        update={"policy_ttl_s": 60.0}))
    for _ in range(10):
        assert sorted(h.node_id for h in (await fleet.cp(sched).LookupPrefix(lookup)).holders) == gold
    assert listings <= 1, f"{listings} node listings for 10 lookups of 8 holders"

    grant = pb.IssuePullGrantRequest(namespace=ns_pb("tenant-p"), source_node_id="gold-0",
                                     consumer_public_key=PEER_KEY)
    await expect(silver.IssuePullGrant(grant), grpc.StatusCode.PERMISSION_DENIED, "no pull grant")
    _, gold_consumer = await fleet.key("node", node_id="gold-9", pool="gold")
    assert (await fleet.cp(gold_consumer).IssuePullGrant(grant)).token  # control: a node of the pool gets one

    await fleet.admin.SetPolicy(tpb.SetPolicyRequest(tenant_id="tenant-p", policy=tpb.TenantPolicy(
        allowed_pools=["silver"])))
    assert not (await fleet.cp(sched).LookupPrefix(lookup)).holders


async def _node_cp(fleet, node_id):
    _, key = await fleet.key("node", node_id=node_id)
    cp = fleet.cp(key)
    await cp.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(node_id=node_id,
                                                                  data_plane_address="127.0.0.1:7001")))
    return cp


async def test_a_nodes_absurd_figure_for_its_own_engine_does_not_take_another_tenants_routes(fleet, control_plane):
    """Found by the reviewer (F3a, /tmp/attack/p14_figures.py): node-x's key reported its own engine's prefill as
    1e300 tokens/s (finite, so accepted); the victim's cost-aware Route, candidates node-x (200,000 running tokens,
    50 waiting) and node-y (idle), then picked node-x. Now a figure past anything measured is INVALID_ARGUMENT,
    and a report within bounds moves a figure by at most stats.MAX_STEP (4x). Control: a plausible report moves a
    route whose candidates are close."""
    await fleet.tenant("victim")
    _, scheduler = await fleet.key("scheduler", tenant_id="victim")
    victim = fleet.cp(scheduler)
    node_x = await _node_cp(fleet, "node-x")

    async def route(*candidates: tuple[str, str, int, int]) -> str:
        reply = await victim.Route(pb.RouteRequest(
            namespace=ns_pb("victim"), token_ids=TOKENS, policy=pb.ROUTE_POLICY_COST_AWARE,
            candidates=[pb.EngineCandidate(engine_id=e, node_id=n, running_tokens=r, waiting_requests=w)
                        for e, n, r, w in candidates]))
        return reply.engine_id

    async def report(engine: str, tps: float):
        return await node_x.ReportStats(pb.ReportStatsRequest(engines=[pb.EngineSample(engine_id=engine,
                                                                                       prefill_tokens_per_s=tps)]))

    # control: a plausible report moves a close route (3,000 vs 2,000 queued tokens at the default 10,000/s)
    close = [("node-x:1", "node-x", 3_000, 0), ("engine-y", "node-y", 2_000, 0)]
    assert await route(*close) == "engine-y"
    await report("node-x:1", 10_000.0)
    await report("node-x:1", 40_000.0)  # the average: 19,000 tokens/s
    assert await route(*close) == "node-x:1"

    heavy = [("node-x", "node-x", 200_000, 50), ("engine-y", "node-y", 0, 0)]
    assert await route(*heavy) == "engine-y"
    await expect(report("node-x", 1e300), grpc.StatusCode.INVALID_ARGUMENT, "prefill_tokens_per_s")
    assert await route(*heavy) == "engine-y", "a figure of 1e300 tokens/s took the route"  # red before: node-x
    await report("node-x", 10_000.0)
    await report("node-x", 1e8)  # within the bound, but 10,000x the figure: one report moves it 4x at most
    store = control_plane.core.router._stats
    assert float(await store._redis.hget(store.engine_key, "node-x")) == pytest.approx(40_000.0)
    assert await route(*heavy) == "engine-y", "one report of 1e8 tokens/s took the route"


async def test_a_route_never_picks_a_candidate_on_a_node_the_tenants_policy_excludes(fleet):
    """Found by the reviewer (F3b): a cost-aware Route of the victim (policy allowed_nodes=[node-y]) picked a
    candidate on node-x, whose key had reported its engine fast. The candidates the namespace's tenant policy
    excludes are now dropped before any policy runs, whatever the figures say; with none left the Route is
    FAILED_PRECONDITION naming the nodes the policy allows. Control: with the policy allowing node-x, it is picked."""
    await fleet.tenant("victim", allowed_nodes=["node-y"])
    _, scheduler = await fleet.key("scheduler", tenant_id="victim")
    victim = fleet.cp(scheduler)
    cands = [pb.EngineCandidate(engine_id="engine-x", node_id="node-x"),  # idle: the best by every policy
             pb.EngineCandidate(engine_id="engine-y", node_id="node-y", running_tokens=200_000, waiting_requests=50)]

    async def route(policy, candidates=cands) -> str:
        return (await victim.Route(pb.RouteRequest(namespace=ns_pb("victim"), token_ids=TOKENS, policy=policy,
                                                   candidates=candidates))).engine_id

    policies = [pb.ROUTE_POLICY_COST_AWARE, pb.ROUTE_POLICY_LOAD_AWARE, pb.ROUTE_POLICY_TOKEN_AWARE,
                pb.ROUTE_POLICY_AFFINITY]
    for policy in policies:
        assert await route(policy) == "engine-y", f"policy {policy} ran the tenant's prompt on node-x"  # red before
    await expect(route(pb.ROUTE_POLICY_COST_AWARE, cands[:1]), grpc.StatusCode.FAILED_PRECONDITION,
                 "allowed_nodes: 'node-y'")
    # a key that may not read the tenant (node-x's) is answered as for a tenant that does not exist: no oracle
    _, node_x = await fleet.key("node", node_id="node-x")
    for tenant in ("victim", "no-such-tenant"):
        reply = await fleet.cp(node_x).Route(pb.RouteRequest(namespace=ns_pb(tenant), token_ids=TOKENS,
                                                             candidates=cands[:1]))
        assert reply.engine_id == "engine-x" and not reply.HasField("kv_source")
    await fleet.admin.SetPolicy(tpb.SetPolicyRequest(tenant_id="victim", policy=tpb.TenantPolicy(
        allowed_nodes=["node-x", "node-y"])))
    for policy in policies:  # control
        assert await route(policy) == "engine-x"


async def test_one_node_cannot_open_its_tenants_namespace_limit_for_the_others(fleet):
    """Found by the reviewer (F4, /tmp/attack/p6_namespace_crowd.py): one node key opened made-up namespaces of its
    tenant up to the tenant's limit, and the tenant's honest node was then refused (RESOURCE_EXHAUSTED) publishing a
    new model. Now one node opens at most half of the limit (checked in the claim's Lua script); the tenant-wide
    limit still holds, and a node the policy allows alone may open all of it."""
    await fleet.tenant("tenant-n", max_namespaces=4)

    async def opener(node_id, tenant="tenant-n"):
        cp, seq = await _node_cp(fleet, node_id), 0
        reg = await cp.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(node_id=node_id,
                                                                            data_plane_address="127.0.0.1:7001")))

        async def open_(model: str):
            nonlocal seq
            seq += 1
            ns = common_pb2.Namespace(tenant=tenant, model=model, weight_version="v1",
                                      cache_config=common_pb2.CacheConfig(block_size=32))
            try:
                return await cp.PublishEvents(pb.EventBatch(
                    node_id=node_id, incarnation=reg.incarnation, seq=seq, namespace=ns, events=[pb.KvEvent(
                        stored=pb.BlockStored(block_hashes=hashes(1), block_size=32, medium=common_pb2.MEDIUM_CPU))]))
            except grpc.aio.AioRpcError:
                seq -= 1  # a unary batch refused consumes no seq
                raise
        return open_

    attacker, honest, third = await opener("node-x"), await opener("node-a"), await opener("node-b")
    for i in range(2):
        assert (await attacker(f"made-up-{i}")).status == pb.ACK_STATUS_APPLIED
    await expect(attacker("made-up-2"), grpc.StatusCode.RESOURCE_EXHAUSTED, "its share of them (2")  # red: applied
    for model in ("tiny@rev2", "tiny@rev3"):  # the honest node still opens new models (red before: refused)
        assert (await honest(model)).status == pb.ACK_STATUS_APPLIED
    assert (await honest("made-up-0")).status == pb.ACK_STATUS_APPLIED  # at its share: joining one the tenant has
    # control: the tenant-wide limit (4) still holds, for a node that has opened none
    await expect(third("tiny@rev4"), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit of 4 namespaces")
    assert (await third("tiny@rev2")).status == pb.ACK_STATUS_APPLIED  # a namespace the tenant has

    await fleet.tenant("tenant-s", max_namespaces=4, allowed_nodes=["node-s"])  # control: allowed alone
    alone = await opener("node-s", "tenant-s")
    for i in range(4):
        assert (await alone(f"model-{i}")).status == pb.ACK_STATUS_APPLIED
    await expect(alone("model-4"), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit of 4 namespaces")
