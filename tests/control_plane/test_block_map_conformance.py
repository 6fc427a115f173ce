"""The BlockMap contract (control_plane/block_map.py), against every backend configuration."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from kvmesh import errors
from kvmesh.namespace import CacheConfig, Namespace

from control_plane.model import (
    ALL_TIERS, AckStatus, Cleared, EventBatch, Medium, NodeInfo, PackedHashes, Removed, Stored,
)
from control_plane.redis_block_map import RedisBlockMap


def node(i: int) -> NodeInfo:
    return NodeInfo(f"node-{i}", f"127.0.0.1:{7000 + i}")


def hashes(n: int, tag: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


class Publisher:
    """Plays one node: registers, then sends numbered batches."""

    def __init__(self, bm, ns, i: int) -> None:
        self.bm, self.ns, self.node, self.seq, self.inc = bm, ns, node(i), 0, 0

    async def register(self):
        self.inc = (await self.bm.register_node(self.node)).incarnation
        self.seq = 0
        return self

    async def send(self, *events, reset=False, seq=None):
        self.seq = self.seq + 1 if seq is None else seq
        batch = EventBatch(self.node.node_id, self.inc, self.seq, self.ns, tuple(events), reset)
        return await self.bm.apply_batch(batch.validate(1 << 20))

    async def store(self, hs, medium=Medium.CPU):
        return await self.send(Stored(tuple(hs), medium, self.ns.cache_config.block_size))


async def holders(bm, ns, hs, tiers=ALL_TIERS):
    match = await bm.lookup_prefix(ns, hs, tiers)
    return {h.node_id: h for h in match.holders}


async def test_register_gives_increasing_incarnations(block_map):
    a = await block_map.register_node(node(1))
    b = await block_map.register_node(node(1))
    assert b.incarnation == a.incarnation + 1
    assert a.next_seq == 1


async def test_a_node_id_apart_from_a_registered_one_only_by_case_is_refused(block_map):
    """A certificate naming dp2 passes a TLS check for DP2 (DNS names are case-insensitive), so a fleet with both
    would let either node's certificate answer as the other. Controls: the same id registers again; an id apart
    by more registers; once dp2 is deregistered, DP2 may take the name."""
    first = await block_map.register_node(NodeInfo("dp2", "127.0.0.1:7002"))
    with pytest.raises(errors.AlreadyExists, match="differs from registered node 'dp2' only by case"):
        await block_map.register_node(NodeInfo("DP2", "127.0.0.1:7003"))
    assert "DP2" not in {s.node.node_id for s in await block_map.list_nodes()}
    assert (await block_map.register_node(NodeInfo("dp2", "127.0.0.1:7002"))).incarnation == first.incarnation + 1
    await block_map.register_node(NodeInfo("dp20", "127.0.0.1:7020"))
    await block_map.deregister_node("dp2", first.incarnation + 1)
    await block_map.register_node(NodeInfo("DP2", "127.0.0.1:7003"))
    with pytest.raises(errors.AlreadyExists, match="registered node 'DP2'"):
        await block_map.register_node(NodeInfo("dp2", "127.0.0.1:7002"))


async def test_lookup_returns_leading_blocks_per_node_and_tier(block_map, ns):
    hs = hashes(10)
    p1, p2 = await Publisher(block_map, ns, 1).register(), await Publisher(block_map, ns, 2).register()
    await p1.store(hs[:10], Medium.CPU)
    await p1.store(hs[:4], Medium.GPU)
    await p2.store(hs[:6], Medium.DISK)
    found = await holders(block_map, ns, hs)
    assert found["node-1"].leading_blocks == 10
    assert found["node-1"].per_tier == {Medium.GPU: 4, Medium.CPU: 10, Medium.DISK: 0}
    assert found["node-2"].leading_blocks == 6
    assert found["node-1"].data_plane_address == "127.0.0.1:7001"
    match = await block_map.lookup_prefix(ns, hs, ALL_TIERS)
    assert [h.node_id for h in match.holders] == ["node-1", "node-2"]  # longest first


async def test_a_lookup_of_packed_hashes_answers_as_the_same_hashes_in_a_list(block_map, ns):
    hs = hashes(10)
    p1, p2 = await Publisher(block_map, ns, 1).register(), await Publisher(block_map, ns, 2).register()
    await p1.store(hs[:10], Medium.CPU)
    await p1.store(hs[:4], Medium.GPU)
    await p2.store(hs[:6], Medium.DISK)
    for cut in (1, 4, 6, 10):
        for tiers in (ALL_TIERS, Medium.GPU.bit, Medium.DISK.bit):
            listed = await block_map.lookup_prefix(ns, hs[:cut], tiers)
            packed = await block_map.lookup_prefix(ns, PackedHashes(b"".join(hs[:cut]), 32), tiers)
            assert listed.holders  # positive control: there is an answer to compare
            assert packed == listed
    absent = await block_map.lookup_prefix(ns, PackedHashes(b"".join(hashes(3, "never")), 32), ALL_TIERS)
    assert absent.holders == [] and absent.blocks_queried == 3


async def test_lookup_counts_only_the_leading_run(block_map, ns):
    hs = hashes(8)
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs[:3] + hs[4:])  # a hole at block 3
    assert (await holders(block_map, ns, hs))["node-1"].leading_blocks == 3


async def test_lookup_mixes_tiers_for_the_any_count(block_map, ns):
    hs = hashes(6)
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs[:3], Medium.GPU)
    await p.store(hs[3:], Medium.CPU)
    h = (await holders(block_map, ns, hs))["node-1"]
    assert h.leading_blocks == 6
    assert h.per_tier[Medium.GPU] == 3 and h.per_tier[Medium.CPU] == 0


async def test_tier_filter(block_map, ns):
    hs = hashes(4)
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs, Medium.GPU)
    assert await holders(block_map, ns, hs, Medium.CPU.bit | Medium.DISK.bit) == {}
    assert (await holders(block_map, ns, hs, Medium.GPU.bit))["node-1"].leading_blocks == 4


async def test_empty_and_unknown_lookups(block_map, ns):
    assert (await block_map.lookup_prefix(ns, [], ALL_TIERS)).holders == []
    match = await block_map.lookup_prefix(ns, hashes(3, "never"), ALL_TIERS)
    assert match.holders == [] and match.blocks_queried == 3


async def test_removed_one_tier_and_all_tiers(block_map, ns):
    hs = hashes(4)
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs, Medium.GPU)
    await p.store(hs, Medium.CPU)
    await p.send(Removed(tuple(hs[2:3]), Medium.GPU))
    h = (await holders(block_map, ns, hs))["node-1"]
    assert h.per_tier[Medium.GPU] == 2 and h.per_tier[Medium.CPU] == 4
    await p.send(Removed(tuple(hs[1:2]), None))
    assert (await holders(block_map, ns, hs))["node-1"].leading_blocks == 1


async def test_removing_unknown_blocks_is_harmless(block_map, ns):
    p = await Publisher(block_map, ns, 1).register()
    ack = await p.send(Removed(tuple(hashes(2, "x")), Medium.CPU))
    assert ack.status is AckStatus.APPLIED


async def test_all_blocks_cleared_every_tier_and_one_tier(block_map, ns):
    hs = hashes(4)
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs, Medium.GPU)
    await p.store(hs, Medium.CPU)
    await p.send(Cleared(Medium.GPU))
    h = (await holders(block_map, ns, hs))["node-1"]
    assert h.per_tier[Medium.GPU] == 0 and h.per_tier[Medium.CPU] == 4
    await p.send(Cleared(None), Stored(tuple(hs[:1]), Medium.CPU, 32))  # clear, then store again
    assert (await holders(block_map, ns, hs))["node-1"].leading_blocks == 1


async def test_duplicate_batch_changes_nothing(block_map, ns):
    hs = hashes(2)
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs)
    await p.send(Removed(tuple(hs), None))
    ack = await p.send(Stored(tuple(hs), Medium.CPU, 32), seq=1)  # a late replay of batch 1
    assert ack.status is AckStatus.DUPLICATE
    assert await holders(block_map, ns, hs) == {}


async def test_gap_asks_for_resync_and_reset_recovers(block_map, ns):
    old, new = hashes(3, "old"), hashes(3, "new")
    p = await Publisher(block_map, ns, 1).register()
    await p.store(old)
    ack = await p.send(Stored(tuple(new), Medium.CPU, 32), seq=5)
    assert ack.status is AckStatus.RESYNC_REQUIRED and ack.expected_seq == 2
    assert await holders(block_map, ns, new) == {}  # nothing of the gapped batch applied
    ack = await p.send(Stored(tuple(new), Medium.CPU, 32), reset=True, seq=6)
    assert ack.status is AckStatus.APPLIED
    assert await holders(block_map, ns, old) == {}  # the snapshot replaced what was known
    assert (await holders(block_map, ns, new))["node-1"].leading_blocks == 3
    assert (await p.send(Stored(tuple(old), Medium.CPU, 32), seq=7)).status is AckStatus.APPLIED


async def test_replayed_reset_does_not_wipe_newer_state(block_map, ns):
    hs = hashes(2)
    p = await Publisher(block_map, ns, 1).register()
    await p.send(Stored(tuple(hs[:1]), Medium.CPU, 32), reset=True)  # seq 1
    await p.store(hs[1:])  # seq 2
    ack = await p.send(Stored(tuple(hs[:1]), Medium.CPU, 32), reset=True, seq=1)
    assert ack.status is AckStatus.DUPLICATE
    assert (await holders(block_map, ns, hs))["node-1"].leading_blocks == 2


async def test_reregistration_fences_old_entries(block_map, ns):
    hs = hashes(3)
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs)
    stale_inc = p.inc
    await p.register()
    assert await holders(block_map, ns, hs) == {}
    with pytest.raises(errors.FailedPrecondition, match="stale incarnation"):
        await block_map.heartbeat("node-1", stale_inc)
    with pytest.raises(errors.FailedPrecondition):
        await block_map.apply_batch(EventBatch("node-1", stale_inc, 9, ns, (Stored(tuple(hs), Medium.CPU, 32),)))


async def test_unknown_node_is_not_found(block_map, ns):
    with pytest.raises(errors.NotFound, match="unknown node"):
        await block_map.heartbeat("ghost", 1)
    with pytest.raises(errors.NotFound):
        await block_map.apply_batch(EventBatch("ghost", 1, 1, ns, (Cleared(None),)))


async def test_deregistered_node_is_fenced(block_map, ns):
    hs = hashes(2)
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs)
    await block_map.deregister_node("node-1", p.inc)
    assert await holders(block_map, ns, hs) == {}
    status = {s.node.node_id: s for s in await block_map.list_nodes()}
    assert "node-1" not in status or not status["node-1"].live


async def test_lease_expiry_fences_and_heartbeat_keeps_alive(store_url, key_prefix, ns):
    # A 3 s lease and a heartbeat every 0.2 s: a loaded machine would have to stall 15x to flake it.
    bm = RedisBlockMap(store_url, lease_ms=3000, key_prefix=key_prefix)
    try:
        hs = hashes(2)
        alive, dying = await Publisher(bm, ns, 1).register(), await Publisher(bm, ns, 2).register()
        await alive.store(hs)
        await dying.store(hs)
        for _ in range(300):  # until node-2's lease has expired (ordering, not speed)
            await asyncio.sleep(0.2)
            await bm.heartbeat("node-1", alive.inc)
            if set(await holders(bm, ns, hs)) == {"node-1"}:
                break
        assert set(await holders(bm, ns, hs)) == {"node-1"}
        with pytest.raises(errors.FailedPrecondition, match="expired"):
            await bm.heartbeat("node-2", dying.inc)
        with pytest.raises(errors.FailedPrecondition, match="expired"):
            await dying.store(hs)
        nodes = {s.node.node_id: s.live for s in await bm.list_nodes()}
        assert nodes == {"node-1": True, "node-2": False}
    finally:
        await bm.close()


async def test_garbage_collection_frees_fenced_entries_and_reuses_slots_safely(block_map, ns, store_url, key_prefix):
    hs = hashes(50)
    p1, p2 = await Publisher(block_map, ns, 1).register(), await Publisher(block_map, ns, 2).register()
    await p1.store(hs)
    await p2.store(hs)
    await block_map.deregister_node("node-1", p1.inc)
    assert await block_map.collect_garbage() == 1
    # node-2 is untouched; node-1's entries are gone from the store, not just hidden.
    assert set(await holders(block_map, ns, hs)) == {"node-2"}
    raw = await block_map._redis.hget(block_map._keys.blocks(ns), hs[0])
    assert len(raw) == 2
    # many registrations later, a reused slot never resurrects old entries
    for _ in range(5):
        await Publisher(block_map, ns, 1).register()
        await block_map.collect_garbage()
    assert set(await holders(block_map, ns, hs)) == {"node-2"}


async def test_namespaces_never_share_blocks(block_map, ns):
    hs = hashes(3)
    other_tenant = Namespace("globex", ns.model, ns.weight_version, ns.cache_config)
    other_weights = Namespace(ns.tenant, ns.model, "v2", ns.cache_config)
    other_seed = Namespace(ns.tenant, ns.model, ns.weight_version, CacheConfig(32, hash_seed="7"))
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs)
    for other in (other_tenant, other_weights, other_seed):
        assert await holders(block_map, other, hs) == {}


async def test_a_new_instance_over_the_same_store_answers_the_same(block_map, ns, store_url, key_prefix):
    hs = hashes(5)
    p = await Publisher(block_map, ns, 1).register()
    await p.store(hs)
    replica = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    try:
        a = await block_map.lookup_prefix(ns, hs, ALL_TIERS)
        b = await replica.lookup_prefix(ns, hs, ALL_TIERS)
        assert a == b and a.longest == 5
        # the replica continues the node's sequence where the first instance left it
        batch = EventBatch("node-1", p.inc, p.seq + 1, ns, (Removed(tuple(hs[4:]), None),))
        assert (await replica.apply_batch(batch)).status is AckStatus.APPLIED
        assert (await block_map.lookup_prefix(ns, hs, ALL_TIERS)).longest == 4
    finally:
        await replica.close()


async def test_concurrent_first_lookups_of_a_fresh_replica(block_map, ns, store_url, key_prefix):
    """Regression: a replica's first calls raced its script loading and saw a partly filled table
    (KeyError: INTERNAL) when many lookups arrived at once, as when `kvmesh bench load` scaled to 4 replicas."""
    hs = hashes(40)
    await (await Publisher(block_map, ns, 1).register()).store(hs)
    fresh = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    try:
        await fresh.list_nodes()  # connected (a cluster client learns the topology), no script loaded yet
        async def staggered(i: int):  # arriving one after another, some while the scripts are being loaded
            await asyncio.sleep(i * 0.00025)
            return await fresh.lookup_prefix(ns, hs, ALL_TIERS)

        matches = await asyncio.gather(*(staggered(i) for i in range(24)))
        assert all([h.leading_blocks for h in m.holders] == [40] for m in matches)
    finally:
        await fresh.close()


async def test_concurrent_publishers_and_lookups(block_map, ns):
    hs = hashes(64)
    pubs = [await Publisher(block_map, ns, i).register() for i in range(8)]

    async def publish(p, n):
        for start in range(0, n, 8):
            await p.store(hs[start:start + 8])

    await asyncio.gather(*(publish(p, 8 * (i + 1)) for i, p in enumerate(pubs)),
                         *(block_map.lookup_prefix(ns, hs, ALL_TIERS) for _ in range(20)))
    found = await holders(block_map, ns, hs)
    assert {k: v.leading_blocks for k, v in found.items()} == {f"node-{i}": 8 * (i + 1) for i in range(8)}


async def test_long_prompts_across_read_chunks(block_map, ns):
    hs = hashes(300)
    p1, p2 = await Publisher(block_map, ns, 1).register(), await Publisher(block_map, ns, 2).register()
    await p1.store(hs)
    await p2.store(hs[:100] + hs[150:])
    await p2.send(Stored(tuple(hs[:40]), Medium.GPU, 32))
    found = await holders(block_map, ns, hs)
    assert found["node-1"].leading_blocks == 300
    assert found["node-2"].leading_blocks == 100
    assert found["node-2"].per_tier == {Medium.GPU: 40, Medium.CPU: 100, Medium.DISK: 0}


async def test_a_nodes_entry_count_follows_what_it_stores_removes_and_clears(block_map, ns):
    """node_entries (what max_entries_per_node bounds): the blocks the node's current incarnation holds, across its
    namespaces, a block on two tiers once; another node's blocks are not counted; a clear of every tier, a reset
    batch or a new incarnation of the node (each a new slot) starts again from 0. The same per tenant (a node's
    part of its tenant's max_index_entries)."""
    other = Namespace(ns.tenant, "other-model", "v1", ns.cache_config)
    theirs = Namespace(f"{ns.tenant}-b", "tiny-llama", "v1", ns.cache_config)

    async def counts(node_id: str) -> tuple[int, int, int]:
        return (await block_map.node_entries(node_id), await block_map.node_entries(node_id, ns.tenant),
                await block_map.node_entries(node_id, theirs.tenant))
    p1, p2 = await Publisher(block_map, ns, 1).register(), await Publisher(block_map, ns, 2).register()
    n1 = p1.node.node_id
    hs = hashes(10)
    assert await block_map.node_entries(n1) == 0
    await p1.store(hs)
    await p1.store(hs[:4], Medium.DISK)  # the same blocks on a second tier
    await p2.store(hs)
    p1.ns = other
    await p1.store(hashes(5, "other"))
    p1.ns = theirs
    await p1.store(hashes(3, "theirs"), Medium.DISK)
    assert await counts(n1) == (18, 15, 3)
    p1.ns = ns
    await p1.send(Removed(tuple(hs[:2]), None))  # two blocks gone from every tier
    await p1.send(Removed(tuple(hs[2:4]), Medium.CPU))  # two still on disk
    await p1.store(hs[5:7])  # stored again: already held
    assert await counts(n1) == (16, 13, 3)
    await p1.send(Cleared(Medium.DISK))  # hs[2:4] lose their last tier, and the other tenant's blocks theirs
    assert await counts(n1) == (11, 11, 0)
    await p1.send(Cleared(None))
    assert await counts(n1) == (0, 0, 0)
    await p1.store(hs[:3])
    assert await counts(n1) == (3, 3, 0) and await counts(p2.node.node_id) == (10, 10, 0)
    await block_map.collect_garbage()
    assert await counts(n1) == (3, 3, 0)
    await p1.send(Stored(tuple(hs[:2]), Medium.CPU, ns.cache_config.block_size), reset=True)  # a new slot
    assert await counts(n1) == (2, 2, 0)
    await p1.register()
    assert await counts(n1) == (0, 0, 0) and await counts("never-registered") == (0, 0, 0)
