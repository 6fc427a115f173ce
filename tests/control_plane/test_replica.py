"""The in-memory block-map replica (control_plane/replica.py) against real Redis servers and a Redis Cluster:
it converges on what lookup.lua answers after stores, removals and fencing; on a randomised workload its
answers equal the script's (and a corrupted change record is caught by that comparison); it resyncs after a
gap in the change stream and after Redis restarts, with or without its data."""

from __future__ import annotations

import asyncio
import hashlib
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis.exceptions

from kvmesh.namespace import Namespace
from kvmesh.redis_client import connect
from kvmesh.redis_keys import Keys
from kvmesh_apps.redis_server import RedisCluster, RedisServer, cli_for, find_redis_server

from control_plane.model import ALL_TIERS, Cleared, EventBatch, Medium, NodeInfo, Removed, Stored
from control_plane.redis_block_map import RedisBlockMap
from control_plane.replica import BlockMapReplica


def hashes(n: int, tag: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


class Node:
    """Plays one node against a block map: registers, then sends numbered batches."""

    def __init__(self, bm: RedisBlockMap, ns: Namespace, i: int) -> None:
        self.bm, self.ns, self.info, self.seq, self.inc = bm, ns, NodeInfo(f"node-{i}", f"127.0.0.1:{7000 + i}"), 0, 0

    async def register(self) -> "Node":
        self.inc, self.seq = (await self.bm.register_node(self.info)).incarnation, 0
        return self

    async def send(self, *events, reset: bool = False) -> None:
        self.seq += 1
        await self.bm.apply_batch(EventBatch(self.info.node_id, self.inc, self.seq, self.ns, tuple(events), reset)
                                  .validate(1 << 20))

    async def store(self, hs, medium=Medium.CPU) -> None:
        await self.send(Stored(tuple(hs), medium, self.ns.cache_config.block_size))


def summary(match) -> list:
    return [(h.node_id, h.leading_blocks, sorted(h.per_tier.items())) for h in match.holders]


async def same_answers(bm: RedisBlockMap, replica: BlockMapReplica, ns: Namespace, queries, tiers=(ALL_TIERS,)):
    """None when the replica answers every query as lookup.lua does, else the first difference."""
    key = await bm.blocks_key(ns)
    for query in queries:
        for t in tiers:
            script = summary(await bm.lookup_prefix(ns, query, t))
            mine = replica.lookup(key, query, t)
            if mine is None or summary(mine) != script:
                return (len(query), t, script, mine and summary(mine))
    return None


async def converged(bm, replica, ns, queries, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (diff := await same_answers(bm, replica, ns, queries)) is not None:
        assert time.monotonic() < deadline, f"the replica did not converge: {diff}"
        await asyncio.sleep(0.02)


async def following(url: str, key_prefix: str, bm: RedisBlockMap, ns: Namespace) -> BlockMapReplica:
    replica = BlockMapReplica.from_url(url, key_prefix=key_prefix)
    replica.follow(await bm.blocks_key(ns))
    assert await replica.wait_synced(await bm.blocks_key(ns), 10)
    return replica


async def test_replica_converges_after_stores_removals_and_fencing(store_url, key_prefix, ns):
    bm = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    a, b = await Node(bm, ns, 1).register(), await Node(bm, ns, 2).register()
    hs = hashes(40, "conv")
    await a.store(hs[:30], Medium.GPU)  # loaded by the replica's first scan
    replica = await following(store_url, key_prefix, bm, ns)
    queries = [hs, hs[:10], hs[5:]]
    try:
        await converged(bm, replica, ns, queries)
        assert replica.lookup(await bm.blocks_key(ns), hs).longest == 30  # positive control: it holds data
        await b.store(hs, Medium.CPU)
        await a.send(Removed(tuple(hs[10:12]), Medium.GPU))
        await converged(bm, replica, ns, queries)
        await b.send(Cleared(Medium.CPU))  # one tier: a sweep
        await converged(bm, replica, ns, queries)
        await b.store(hs[:5], Medium.DISK)
        await a.register()  # fenced: a's entries stop counting at once
        await converged(bm, replica, ns, queries)
        assert {h.node_id for h in replica.lookup(await bm.blocks_key(ns), hs).holders} == {"node-2"}
        await b.send(Cleared(None))  # every tier: the slot rotates
        await converged(bm, replica, ns, queries)
        assert replica.lookup(await bm.blocks_key(ns), hs).holders == []
        await b.store(hs[:3], Medium.GPU)
        await bm.deregister_node(a.info.node_id, a.inc)
        assert await bm.collect_garbage() >= 1  # the sweep of the retired slots reaches the replica too
        await converged(bm, replica, ns, queries)
    finally:
        await replica.close()
        await bm.close()


async def test_a_table_the_follower_grows_keeps_every_block_and_answers_meanwhile(store_url, key_prefix, ns):
    """The replica loads a small namespace, then follows stores that take its table through several grows (each
    built off the event loop into a copy, then swapped in): afterwards it answers every block as lookup.lua does,
    and a lookup made while the follower was growing answered from the table it had (never None, never an error).
    Red when a grow loses blocks, or when the table is rehashed in place (in the loop) instead of swapped."""
    bm = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    a = await Node(bm, ns, 1).register()
    first = hashes(8, "grow-first")
    await a.store(first)
    replica = await following(store_url, key_prefix, bm, ns)
    key = await bm.blocks_key(ns)
    loaded = replica.table(key)
    capacity = loaded.capacity
    answers = []

    async def look() -> None:
        while True:
            answers.append(replica.lookup(key, first))
            await asyncio.sleep(0)

    looking = asyncio.ensure_future(look())
    try:
        batches = [hashes(512, f"grow-{i}-") for i in range(12)]
        for hs in batches:
            await a.store(hs)
        queries = [first] + batches
        await converged(bm, replica, ns, queries)
        assert replica.table(key).capacity >= 4 * capacity  # it grew, more than once
        assert replica.table(key) is not loaded  # into copies swapped in, not rehashed in place in the event loop
        assert len(replica.table(key)) == 8 + 12 * 512
        assert answers and all(m is not None and m.longest == 8 for m in answers)
    finally:
        looking.cancel()
        await replica.close()
        await bm.close()


async def test_replica_answers_as_the_script_on_a_randomised_workload(store_url, key_prefix, ns):
    rng = random.Random(22)
    bm = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    nodes = [await Node(bm, ns, i).register() for i in range(6)]
    prompts = [hashes(48, f"p{p}") for p in range(4)]
    replica = await following(store_url, key_prefix, bm, ns)
    media = [Medium.GPU, Medium.CPU, Medium.DISK, None]
    try:
        for _ in range(120):
            node, prompt = rng.choice(nodes), rng.choice(prompts)
            start, end = sorted(rng.sample(range(len(prompt) + 1), 2))
            kind = rng.random()
            if kind < 0.6:
                await node.store(prompt[start:end], rng.choice(media[:3]))
            elif kind < 0.9:
                await node.send(Removed(tuple(prompt[start:end]), rng.choice(media)))
            elif kind < 0.95:
                await node.send(Cleared(rng.choice(media)))
            else:
                await node.register()
        queries = [p[:n] for p in prompts for n in (1, 7, 48)] + [p[3:] for p in prompts]
        tiers = (ALL_TIERS, Medium.GPU.bit, Medium.CPU.bit | Medium.DISK.bit)
        deadline = time.monotonic() + 10
        while (diff := await same_answers(bm, replica, ns, queries, tiers)) is not None:
            assert time.monotonic() < deadline, f"replica and script differ: {diff}"
            await asyncio.sleep(0.05)

        # Negative control: a change record Redis never applied (a replica fed wrong input) is caught.
        key = await bm.blocks_key(ns)
        raw = connect(store_url)
        slot = next(iter(replica.slots))  # a live slot: a forged entry under it would be believed
        seq = await raw.incr(Keys.block_changes_seq(key))
        await raw.xadd(Keys.block_changes(key), {"t": "a", "ms": 0, "s": slot, "hl": 32,
                                                 "3": b"s1" + b"".join(p[0] for p in prompts)}, id=f"{seq}-0")
        await raw.aclose()
        deadline = time.monotonic() + 10
        while await same_answers(bm, replica, ns, queries, tiers) is None:
            assert time.monotonic() < deadline, "the comparison did not notice the forged record"
            await asyncio.sleep(0.02)
    finally:
        await replica.close()
        await bm.close()


async def test_a_gap_in_the_change_stream_makes_the_replica_resync(store_url, key_prefix, ns):
    bm = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    a = await Node(bm, ns, 1).register()
    hs = hashes(20, "gap")
    replica = await following(store_url, key_prefix, bm, ns)
    try:
        await a.store(hs[:5])
        await converged(bm, replica, ns, [hs])
        assert replica.resyncs == 0
        key = await bm.blocks_key(ns)
        # Records 1..n the replica never reads (as when MAXLEN trimmed the stream past it).
        raw = connect(store_url)
        await raw.incrby(Keys.block_changes_seq(key), 3)
        await raw.aclose()
        await a.store(hs[:15])
        await converged(bm, replica, ns, [hs])
        assert replica.resyncs >= 1
        assert replica.lookup(key, hs).longest == 15
    finally:
        await replica.close()
        await bm.close()


async def _restart_test(tmp_path: Path, key_prefix: str, ns: Namespace, lose_data: bool) -> None:
    server = RedisServer(tmp_path / "redis").start()
    bm = RedisBlockMap(server.url, lease_ms=60_000, key_prefix=key_prefix)
    hs = hashes(24, "restart")
    replica = None
    try:
        a = await Node(bm, ns, 1).register()
        await a.store(hs[:10])
        replica = await following(server.url, key_prefix, bm, ns)
        await converged(bm, replica, ns, [hs])
        server.stop()
        if lose_data:  # a failover to a replica that had nothing yet, or a restart without persistence
            shutil.rmtree(tmp_path / "redis" / "appendonlydir", ignore_errors=True)
        server.start()
        b = Node(bm, ns, 2)
        for _ in range(20):  # the writer's pooled connections died with the server: retried, as publishers do
            try:
                await b.register()
                break
            except redis.exceptions.ConnectionError:
                await asyncio.sleep(0.1)
        await b.store(hs[:20], Medium.GPU)
        if not lose_data:
            await a.store(hs[10:12])
        await converged(bm, replica, ns, [hs, hs[:4]], timeout_s=20)
        expect = {"node-2"} if lose_data else {"node-1", "node-2"}
        assert {h.node_id for h in replica.lookup(await bm.blocks_key(ns), hs).holders} == expect
        assert replica.resyncs >= 1
    finally:
        if replica is not None:  # a failed run's follower must not log into later tests
            await replica.close()
        await bm.close()
        server.stop()


async def test_replica_resyncs_after_a_redis_restart(tmp_path, key_prefix, ns):
    await _restart_test(tmp_path, key_prefix, ns, lose_data=False)


async def test_replica_resyncs_after_redis_lost_its_data(tmp_path, key_prefix, ns):
    await _restart_test(tmp_path, key_prefix, ns, lose_data=True)


async def test_replica_resyncs_after_a_cluster_shard_fails_over(tmp_path, key_prefix, ns):
    """The primary holding the namespace's slot dies; its replica takes over: the replica reloads from it and
    follows the new primary (and it converges on lookup.lua's answers again)."""
    cluster = RedisCluster(tmp_path / "cluster", masters=3, replicas=1).start()
    bm = RedisBlockMap(cluster.seeds_url, lease_ms=60_000, key_prefix=key_prefix)
    hs = hashes(24, "failover")
    replica = None
    try:
        a = await Node(bm, ns, 1).register()
        await a.store(hs[:10])
        replica = BlockMapReplica.from_url(cluster.seeds_url, key_prefix=key_prefix)
        key = await bm.blocks_key(ns)
        replica.follow(key)
        assert await replica.wait_synced(key, 20)
        await converged(bm, replica, ns, [hs])
        await asyncio.sleep(0.5)  # the shard's replica has the writes (asynchronous replication)
        raw = connect(cluster.seeds_url)
        await raw.initialize()
        port = raw.get_node_from_key(key).port
        await raw.aclose()
        dead = next(n for n in cluster.nodes if n.port == port)
        dead.stop()
        survivor = next(n for n in cluster.nodes if n is not dead)
        deadline = time.monotonic() + 90
        while True:  # the shard's replica is promoted (slow on a loaded machine: elections time out and retry)
            info = subprocess.run([cli_for(find_redis_server()), "-p", str(survivor.port), "cluster", "info"],
                                  capture_output=True, text=True).stdout
            if "cluster_state:ok" in info:
                break
            assert time.monotonic() < deadline, "the cluster did not fail over"
            await asyncio.sleep(0.5)
        await bm.close()  # a writer that starts after the failover (the replica under test recovers by itself)
        bm = a.bm = RedisBlockMap(cluster.seeds_url, lease_ms=60_000, key_prefix=key_prefix)
        while True:
            try:
                await a.store(hs[:20])
                break
            except Exception:  # noqa: BLE001 - moved slots, connections to the dead node, until it settles
                a.seq -= 1  # the same batch again
                assert time.monotonic() < deadline, "the cluster did not accept writes after failing over"
                await asyncio.sleep(0.5)
        await converged(bm, replica, ns, [hs, hs[:5]], timeout_s=30)
        assert replica.lookup(key, hs).longest == 20 and replica.resyncs >= 1
    finally:
        if replica is not None:
            await replica.close()
        await bm.close()
        cluster.stop()


@pytest.mark.parametrize("swallow", ["returns", "raises"])
async def test_a_follower_ends_when_cancelled_even_inside_a_read_that_swallows_the_cancellation(
        redis_server, key_prefix, swallow):
    """A cancellation that lands inside a Redis call can come back as that call's error, or as nothing. A
    follower then read on for ever, and a replica never closed (a test's leftover) hung the session's last
    teardown for 300 s: asyncio's final cancellation of every task waited on it. Cancelled, the follower now
    ends whatever the read did with the cancellation. Control: uncancelled, it is still reading."""
    replica = BlockMapReplica.from_url(redis_server.url, key_prefix=key_prefix)
    reading = asyncio.Event()

    async def read_that_swallows_cancel(*args, **kwargs):
        reading.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if swallow == "raises":
                raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
        return []

    replica._redis.xread = read_that_swallows_cancel
    replica.start()
    follower = replica._slot_stream.task
    try:
        await asyncio.wait_for(reading.wait(), 10)
        await asyncio.sleep(0.2)
        assert not follower.done()  # control: it is reading, and would go on
        follower.cancel()
        await asyncio.wait_for(asyncio.shield(follower), 5)
    except asyncio.CancelledError:
        pass
    finally:
        await replica.close()
    assert follower.done()
