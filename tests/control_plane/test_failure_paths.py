"""Failure paths the other suites do not reach: a replica dying mid-batch, publishers riding out a Redis
outage, the publisher's answer to RESYNC_REQUIRED, and the background GC loop on its own schedule.

Nothing here asserts speed: each waits (bounded, generously) for an outcome and checks what happened.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.connection import Connection

from kvmesh.grpc_errors import status_for
from kvmesh.namespace import Namespace
from kvmesh.redis_keys import Keys

from control_plane.model import ALL_TIERS, AckStatus, EventBatch, Medium, NodeInfo, Stored
from control_plane.publisher import EventPublisher
from control_plane.redis_block_map import RedisBlockMap
from control_plane.server import serve
from kvmesh_apps.redis_server import RedisServer
from tenancy.auth import auth_metadata
from tenancy.model import Principal, Role, TenantPolicy

ADMIN = Principal("bootstrap", Role.ADMIN)


def hashes(n: int, tag: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


class ReplicaDied(ConnectionError):
    """The replica's process ended between two of its Redis calls."""


async def until(condition, timeout_s: float = 20.0, every_s: float = 0.05) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(every_s)


async def test_a_replica_dying_after_apply_before_end_batch_is_replayed_idempotently(store_url, key_prefix, ns):
    """Scripts applied, last_seq not advanced: the node resends the batch (same seq) to another replica,
    which applies it again; the result is the same as one application (negative control: the batch is not
    answered DUPLICATE, which would mean last_seq had advanced)."""
    dying = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    other = RedisBlockMap(store_url, lease_ms=60_000, key_prefix=key_prefix)
    real_eval = dying._eval

    async def eval_until_end(name, *args, **kwargs):
        if name == "end_batch":
            raise ReplicaDied("replica killed after apply.lua")
        return await real_eval(name, *args, **kwargs)

    dying._eval = eval_until_end
    try:
        node = NodeInfo("node-1", "127.0.0.1:7001")
        inc = (await other.register_node(node)).incarnation
        hs = hashes(6, "mid")
        first = EventBatch("node-1", inc, 1, ns, (Stored(tuple(hs[:4]), Medium.CPU, 32),), False).validate(1 << 20)
        try:
            await dying.apply_batch(first)
            raise AssertionError("the replica should have died mid-batch")
        except ReplicaDied:
            pass
        mid = await other.lookup_prefix(ns, hs, ALL_TIERS)
        assert mid.longest == 4, "apply.lua ran before the replica died"
        replay = await other.apply_batch(first)
        assert replay.status is AckStatus.APPLIED, replay
        after = await other.lookup_prefix(ns, hs, ALL_TIERS)
        assert after.longest == 4 and after.holders[0].per_tier[Medium.CPU] == 4
        assert (await other.apply_batch(first)).status is AckStatus.DUPLICATE  # now last_seq did advance
        nxt = EventBatch("node-1", inc, 2, ns, (Stored(tuple(hs[4:]), Medium.CPU, 32),), False).validate(1 << 20)
        assert (await other.apply_batch(nxt)).status is AckStatus.APPLIED
        assert (await other.lookup_prefix(ns, hs, ALL_TIERS)).longest == 6
    finally:
        await dying.close()
        await other.close()


async def test_concurrent_lookups_on_a_failed_tenant_connection_reconnect_without_a_false_recreation(
        redis_server, key_prefix, ns):
    """Regression (`kvmesh bench load`): when a tenant's connection failed under many concurrent lookups, the
    callers after the first found the client already dropped, took "" for the epoch they had used and answered
    UNAVAILABLE "tenant was deleted and created again" for a tenant nobody re-created. Here the tenant's Redis
    user is switched off and its connections killed while 20 lookups are in flight: all must answer, after one
    reconnection with fresh credentials."""
    admin = aioredis.Redis.from_url(redis_server.url)
    user, password = f"{key_prefix}-tenant", f"pw-{key_prefix}"
    refreshed: list[bool] = []

    async def enable() -> None:
        await admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"])

    async def credentials(tenant: str, failed_before: bool) -> tuple[str, str, str]:
        refreshed.append(failed_before)
        await enable()
        return user, password, "epoch-1"

    await enable()
    bm = RedisBlockMap(redis_server.url, lease_ms=60_000, key_prefix=key_prefix, tenant_credentials=credentials)
    try:
        inc = (await bm.register_node(NodeInfo("node-1", "127.0.0.1:7001"))).incarnation
        hs = hashes(8, "tenant-conn")
        await bm.apply_batch(EventBatch("node-1", inc, 1, ns, (Stored(tuple(hs), Medium.CPU, 32),), False))
        assert (await bm.lookup_prefix(ns, hs, ALL_TIERS)).longest == 8  # positive control: the tenant works
        await admin.acl_setuser(user, enabled=False)
        await admin.client_kill_filter(user=user)
        matches = await asyncio.gather(*(bm.lookup_prefix(ns, hs, ALL_TIERS) for _ in range(20)),
                                       return_exceptions=True)
        assert [m if isinstance(m, Exception) else m.longest for m in matches] == [8] * 20
        assert len(refreshed) == 2  # one reconnection, with fresh credentials, for all 20
    finally:
        await bm.close()
        await admin.acl_deluser(user)
        await admin.aclose()


async def test_redis_py_failing_inside_a_connection_closed_under_it_is_retried_or_unavailable(
        block_map, store_url, ns, monkeypatch):
    """Regression (`kvmesh bench load --soak-minutes 10`, cluster, 2 replicas): redis-py 8 raised AttributeError
    ('NoneType' object has no attribute 'writelines') from a connection closed under a command in flight, and
    LookupPrefix answered INTERNAL. Now a read is retried once (the answer is the right one), a read failing
    again and a write answer UNAVAILABLE (a write may have reached Redis: its caller retries or resyncs).
    redis-py 8.2 raises ConnectionError there instead; its cluster client resends the command itself (it was not
    written) and, when the connection keeps closing, gives up with RedisClusterUnreachableError (UNAVAILABLE too).
    Negative control: without the handling the AttributeError (or RedisClusterUnreachableError) is INTERNAL."""
    if block_map.replica is not None:
        pytest.skip("lookups from the in-memory replica send no Redis command (its followers resync instead)")
    inc = (await block_map.register_node(NodeInfo("node-1", "127.0.0.1:7001"))).incarnation
    hs = hashes(8, "closed-under")
    await block_map.apply_batch(EventBatch("node-1", inc, 1, ns, (Stored(tuple(hs), Medium.CPU, 32),), False))
    original = Connection._send_packed_command
    breaking = {"left": 0}

    async def writer_gone(self, command):
        if breaking["left"]:
            breaking["left"] -= 1
            self._writer = None  # what a concurrent disconnect leaves behind
        return await original(self, command)

    async def answered_unavailable(call) -> None:
        with pytest.raises(Exception) as failed:
            await call
        assert status_for(failed.value)[0] is grpc.StatusCode.UNAVAILABLE, repr(failed.value)

    monkeypatch.setattr(Connection, "_send_packed_command", writer_gone)
    breaking["left"] = 1
    assert (await block_map.lookup_prefix(ns, hs, ALL_TIERS)).longest == 8
    breaking["left"] = 1_000
    await answered_unavailable(block_map.lookup_prefix(ns, hs, ALL_TIERS))
    breaking["left"] = 1
    written = hashes(2, "w")
    write = block_map.apply_batch(EventBatch("node-1", inc, 2, ns, (Stored(tuple(written), Medium.CPU, 32),), False))
    if "+cluster://" in store_url and hasattr(redis.exceptions, "RedisClusterUnreachableError"):
        assert (await write).status is AckStatus.APPLIED  # redis-py >= 8.2 resent the unwritten command
        assert (await block_map.lookup_prefix(ns, written, ALL_TIERS)).longest == 2
    else:
        await answered_unavailable(write)
    breaking["left"] = 0
    assert (await block_map.lookup_prefix(ns, hs, ALL_TIERS)).longest == 8


class Node:
    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.held: list[bytes] = []

    def snapshot(self):
        return [(self.ns, int(Medium.CPU), list(self.held))]


async def _longest(running, ns, hs) -> int:
    return (await running.core.lookup_prefix(ADMIN, ns, hs, [], None, ALL_TIERS)).longest


async def test_publishers_queue_and_retry_while_redis_is_down(tmp_path: Path, cp_config, admin_key, ns):
    """Redis stops (the control plane stays up and answers UNAVAILABLE): the publisher keeps its changes and
    resends them; once Redis is back (AOF), every change is in the map."""
    server = RedisServer(tmp_path / "redis").start()
    running = await serve(cp_config.model_copy(update={"redis_url": server.url}))
    await running.core.tenants.create_tenant("acme", "", TenantPolicy())
    node, hs = Node(ns), hashes(8, "outage")
    pub = EventPublisher(f"127.0.0.1:{running.port}", NodeInfo("node-r", "127.0.0.1:7002"), node.snapshot,
                         metadata=auth_metadata(admin_key), retry_s=0.1)
    await pub.start()
    try:
        node.held = hs[:4]
        pub.stored(ns, hs[:4], int(Medium.CPU))
        assert await pub.flush(10)
        server.stop()
        node.held = hs
        pub.stored(ns, hs[4:], int(Medium.CPU))
        assert not await pub.flush(1.0), "acked while Redis was down"
        server.start()
        assert await pub.flush(30)
        await until(lambda: _eq(_longest(running, ns, hs), 8))
    finally:
        await pub.stop()
        await running.stop()
        server.stop()


async def _eq(value, expected) -> bool:
    return await value == expected


async def test_a_gap_is_answered_resync_and_the_publisher_resyncs_its_snapshot(control_plane, admin_key, ns):
    node, hs = Node(ns), hashes(6, "gap")
    pub = EventPublisher(f"127.0.0.1:{control_plane.port}", NodeInfo("node-g", "127.0.0.1:7003"), node.snapshot,
                         metadata=auth_metadata(admin_key), retry_s=0.1)
    await pub.start()
    try:
        node.held = hs[:2]
        pub.stored(ns, hs[:2], int(Medium.CPU))
        assert await pub.flush(10)
        first = pub.incarnation
        pub._seq += 1  # a batch lost in transit: the next one arrives with a gap
        node.held = hs[:5]
        pub.stored(ns, hs[2:5], int(Medium.CPU))
        assert await pub.flush(20)
        assert pub.incarnation > first, "RESYNC_REQUIRED must make the node register a new incarnation"
        assert await _longest(control_plane, ns, hs) == 5  # the snapshot, not just the batch after the gap
    finally:
        await pub.stop()


async def test_the_gc_loop_sweeps_fenced_entries_on_its_own(cp_config, admin_key, ns, redis_server, caplog):
    """No one calls collect_garbage: the loop started by the server does, and frees the fenced slot's
    entries from Redis (negative control: before the fence the entries are there)."""
    running = await serve(cp_config.model_copy(update={"gc_interval_s": 0.2}))
    try:
        await running.core.tenants.create_tenant("acme", "", TenantPolicy())
        reg = await running.core.register_node(ADMIN, NodeInfo("node-gc", "127.0.0.1:7004"))
        hs = hashes(5, "gc")
        batch = EventBatch("node-gc", reg.incarnation, 1, ns, (Stored(tuple(hs), Medium.CPU, 32),), False)
        assert (await running.core.apply_batch(ADMIN, batch)).status is AckStatus.APPLIED
        r = aioredis.Redis.from_url(redis_server.url)
        key = Keys(cp_config.key_prefix).blocks(ns, (await running.core.tenants.get_tenant("acme")).epoch)
        try:
            assert await r.hlen(key) == 5
            with caplog.at_level(logging.INFO, logger="control_plane.core"):
                await running.core.deregister_node(ADMIN, "node-gc", reg.incarnation)
                assert await _longest(running, ns, hs) == 0  # fenced at once
                await until(lambda: _eq(r.hlen(key), 0))
            assert any("swept" in rec.getMessage() for rec in caplog.records)
        finally:
            await r.aclose()
    finally:
        await running.stop()


async def test_a_lookup_behind_a_stuck_pipeline_on_a_frozen_redis_fails_within_one_bound(tmp_path: Path, ns):
    """Redis frozen (SIGSTOP: the socket is open, nothing answers). A lookup whose command is queued behind the
    pipeline in flight used to wait for that pipeline's 2 s socket timeout and then for its own (about 4 s);
    each lookup now fails within one bound (the socket timeout) of its own start. Positive control: before
    the freeze and after SIGCONT the lookups answer."""
    import os
    import signal
    import time

    from kvmesh.redis_client import SOCKET_TIMEOUT_S

    server = RedisServer(tmp_path / "frozen").start()
    block_map = RedisBlockMap(server.url, lease_ms=60_000, key_prefix="frozen")
    try:
        inc = (await block_map.register_node(NodeInfo("node-1", "127.0.0.1:7001"))).incarnation
        hs = hashes(4, "frozen")
        await block_map.apply_batch(EventBatch("node-1", inc, 1, ns, (Stored(tuple(hs), Medium.CPU, 32),), False))
        assert (await block_map.lookup_prefix(ns, hs, ALL_TIERS)).longest == 4

        async def timed_lookup() -> float:
            start = time.monotonic()
            with pytest.raises(redis.exceptions.TimeoutError):  # what kvmesh.grpc_errors answers UNAVAILABLE
                await block_map.lookup_prefix(ns, hs, ALL_TIERS)
            return time.monotonic() - start

        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            first = asyncio.ensure_future(timed_lookup())
            await asyncio.sleep(0.05)  # the first lookup's pipeline is on the wire, stuck
            second = await timed_lookup()
            first = await first
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert first < SOCKET_TIMEOUT_S + 0.5, f"the stuck lookup took {first:.3f}s"
        assert second < SOCKET_TIMEOUT_S + 0.5, f"the lookup queued behind it took {second:.3f}s (one bound: 2s)"
        print(f"frozen Redis: stuck lookup {first * 1000:.0f} ms, queued lookup {second * 1000:.0f} ms")
        for _ in range(50):  # the server answers again: so do lookups
            try:
                if (await block_map.lookup_prefix(ns, hs, ALL_TIERS)).longest == 4:
                    break
            except Exception:  # noqa: BLE001 - a connection broken by the freeze is replaced
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("lookups never answered again after SIGCONT")
    finally:
        await block_map.close()
        server.stop()


async def test_tenant_redis_users_of_an_older_version_get_this_versions_rules_at_start(cp_config, redis_server):
    """An upgrade: a tenant user an older version made lacks the commands this one runs in the tenant's name (the
    change streams' XADD, INCR, XREAD). A control plane starting on that Redis writes the user again with this
    version's rules; its password stays what the tenant's record derives (the tenant's lookups still work)."""
    first = await serve(cp_config)
    await first.core.tenants.create_tenant("acme", "", TenantPolicy())
    user = first.core.tenants._keys.redis_user("acme")
    await first.stop()

    async def rules() -> str:
        async with aioredis.Redis.from_url(redis_server.url) as r:
            users = await r.execute_command("ACL", "LIST")
        return next(u.decode() for u in users if u.split()[1] == user.encode())

    async with aioredis.Redis.from_url(redis_server.url) as r:
        await r.execute_command("ACL", "SETUSER", user, "-xadd", "-incr", "-xread")  # as an older version made it
    assert "-xadd" in await rules()
    running = await serve(cp_config)
    try:
        now = (await rules()).split()
        assert all(f"+{c}" in now for c in ("xadd", "incr", "xread")), now
        user_, password, _ = await running.core.tenants.redis_credentials("acme")
        async with aioredis.Redis.from_url(redis_server.url, username=user_, password=password) as tenant:
            assert await tenant.ping()  # the same password
    finally:
        await running.stop()


@pytest.mark.parametrize("swallow", ["returns", "raises"])
async def test_stopping_ends_the_gc_loop_even_when_a_collection_swallows_its_cancellation(cp_config, swallow):
    """A cancellation that lands inside a Redis call can come back as that call's error, or as nothing; the GC
    loop then slept on while the control plane's stop waited for it for ever (a test teardown hung 300 s).
    The stop now ends it: the collection in flight swallows the cancel (as such a call does), and the stop
    still returns, the loop done. Control: the same collection, without a stop, is still running."""
    running = await serve(cp_config.model_copy(update={"gc_interval_s": 0.01}))
    entered = asyncio.Event()

    async def collection_that_swallows_cancel() -> int:
        entered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if swallow == "raises":
                raise ConnectionError("Connection closed by server.") from None
        return 0

    running.core.block_map.collect_garbage = collection_that_swallows_cancel
    await asyncio.wait_for(entered.wait(), 10)
    gc_task = running.core._gc_task
    await asyncio.sleep(0.2)
    assert not gc_task.done()  # control: the collection is in flight and would stay so
    await asyncio.wait_for(running.stop(), 10)
    assert gc_task.done()


async def test_a_node_id_apart_from_a_registered_one_only_by_case_is_refused_in_a_line_saying_why(
        control_plane, admin_key, ns, caplog):
    """A node DP2 beside dp2 (TLS names are case-insensitive) is refused at registration; its publisher's log line
    carries the control plane's words, not only a status code. Control: dp2's publisher registers and publishes."""
    node = Node(ns)
    pubs = [EventPublisher(f"127.0.0.1:{control_plane.port}", NodeInfo(node_id, "127.0.0.1:7002"), node.snapshot,
                           metadata=auth_metadata(admin_key), retry_s=0.1) for node_id in ("dp2", "DP2")]
    try:
        await pubs[0].start()

        async def registered() -> bool:
            return pubs[0].incarnation > 0

        await until(registered, timeout_s=10)
        caplog.set_level(logging.WARNING, logger="control_plane.publisher")
        await pubs[1].start()

        async def refused() -> bool:
            return any("ALREADY_EXISTS: node id 'DP2' differs from registered node 'dp2' only by case" in r.message
                       for r in caplog.records)

        await until(refused, timeout_s=10)
        assert not pubs[1].incarnation
    finally:
        for pub in pubs:
            await pub.stop()
