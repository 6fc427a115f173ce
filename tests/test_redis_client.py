"""kvmesh.redis_client against real Redis: the Coalescer on a redis-server (concurrent callers share pipelines, and
each caller still gets its own reply or error); a cluster URL naming several nodes, whose client still finds the
cluster when the first node it names is gone (what a control plane needs after a failover); a cluster no node of
which answers is the store being unavailable, and a command on a node that died fails within the bound of a call."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from redis.exceptions import RedisClusterException

from kvmesh.errors import InvalidArgument
from kvmesh.grpc_errors import status_for
from kvmesh.redis_client import SOCKET_TIMEOUT_S, Coalescer, connect
from kvmesh_apps.redis_server import RedisCluster, free_port


async def _connections_named(url: str, name: str) -> int:
    admin = aioredis.Redis.from_url(url)
    try:
        return sum(1 for c in await admin.client_list() if c.get("name") == name)
    finally:
        await admin.aclose()


async def test_concurrent_callers_share_one_connection_and_get_their_own_replies(redis_server):
    name = f"coalesced-{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(redis_server.url, client_name=name)
    coalescer = Coalescer(client)
    replies = await asyncio.gather(*(coalescer.execute("ECHO", f"m{i}") for i in range(64)))
    assert replies == [f"m{i}".encode() for i in range(64)]
    assert await _connections_named(redis_server.url, name) == 1  # pipelined: one connection served all 64
    await client.aclose()

    # Negative control: the same 64 concurrent commands without the coalescer need many connections.
    name = f"direct-{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(redis_server.url, client_name=name)
    await asyncio.gather(*(client.execute_command("ECHO", f"m{i}") for i in range(64)))
    assert await _connections_named(redis_server.url, name) > 1
    await client.aclose()


async def test_an_error_belongs_to_its_caller(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    key = f"coalesce:{uuid.uuid4().hex}"
    await client.set(key, "not a number")
    coalescer = Coalescer(client)
    replies = await asyncio.gather(coalescer.execute("ECHO", "before"), coalescer.execute("INCR", key),
                                   coalescer.execute("ECHO", "after"), return_exceptions=True)
    assert replies[0] == b"before" and replies[2] == b"after"
    assert isinstance(replies[1], redis.exceptions.ResponseError)
    await client.aclose()


async def test_a_caller_that_gives_up_leaves_the_others_alone(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    coalescer = Coalescer(client)
    first, gone, last = (coalescer.execute("ECHO", m) for m in ("a", "b", "c"))
    gone.cancel()
    assert await first == b"a" and await last == b"c"
    assert await coalescer.execute("ECHO", "next") == b"next"  # and the coalescer goes on
    await client.aclose()


async def test_a_failed_connection_reaches_every_caller_of_the_batch(redis_server):
    client = aioredis.Redis.from_url("redis://127.0.0.1:1", socket_connect_timeout=1)  # nothing listens there
    coalescer = Coalescer(client)
    replies = await asyncio.gather(coalescer.execute("PING"), coalescer.execute("PING"), return_exceptions=True)
    assert all(isinstance(r, redis.exceptions.ConnectionError) for r in replies)
    await client.aclose()


async def test_a_cluster_url_names_several_seeds_and_a_dead_first_one_is_skipped(redis_cluster):
    dead = free_port()  # nothing listens there: the node the URL names first has died
    client = connect(f"redis+cluster://127.0.0.1:{dead}," + redis_cluster.seeds_url.removeprefix("redis+cluster://"))
    try:
        await client.set("{seeds}:k", "v")
        assert await client.get("{seeds}:k") == b"v"
    finally:
        await client.aclose()
    alone = connect(f"redis+cluster://127.0.0.1:{dead}")  # negative control: only the dead node
    try:
        with pytest.raises(RedisClusterException):
            await alone.get("{seeds}:k")
    finally:
        await alone.aclose()


async def test_a_cluster_no_node_of_which_answers_is_unavailable_not_internal(redis_server):
    """redis-py reports a cluster no node of which answers as a RedisClusterException (8.2: its subclass
    RedisClusterUnreachableError), not as a ConnectionError: the control plane answered INTERNAL, as for a bug.
    It is UNAVAILABLE now, as a single server that does not answer is. Negative controls: a cluster URL at a server
    that is no cluster, and a command whose keys span slots, are still INTERNAL."""
    async def failure(client, *command) -> Exception:
        try:
            with pytest.raises(RedisClusterException) as failed:
                await client.execute_command(*command)
        finally:
            await client.aclose()
        return failed.value

    down = await failure(connect(f"redis+cluster://127.0.0.1:{free_port()}"), "GET", "k")
    assert status_for(down)[0] is grpc.StatusCode.UNAVAILABLE, repr(down)
    no_cluster = await failure(connect(f"redis+cluster://127.0.0.1:{redis_server.port}"), "GET", "k")
    cross_slot = RedisClusterException("MGET - all keys must map to the same key slot")
    assert [status_for(exc)[0] for exc in (no_cluster, cross_slot)] == [grpc.StatusCode.INTERNAL] * 2


async def test_a_command_on_a_cluster_whose_node_died_fails_within_the_bound_of_a_call(tmp_path):
    """redis-py 8.2 spaces a cluster client's retries by an exponential backoff (8.1 sent them at once): a GET whose
    primary had died failed after 2-4.4 s, past the socket timeout that bounds a call (8.1: 0.15 s); a replica's
    XREAD could wait out a failover that way, unseen. It fails as fast as on 8.1 now. Control: the other keys answer."""
    cluster = RedisCluster(tmp_path / "cluster").start()
    client = connect(cluster.seeds_url)
    try:
        keys = [f"{{k{i}}}" for i in range(16)]  # on every node
        for key in keys:
            await client.set(key, "v")
        port = client.get_node_from_key(keys[0]).port
        next(node for node in cluster.nodes if node.port == port).stop()
        assert await client.get(next(k for k in keys if client.get_node_from_key(k).port != port)) == b"v"
        start = time.monotonic()
        with pytest.raises(Exception) as failed:
            await client.get(keys[0])
        elapsed = time.monotonic() - start
        assert status_for(failed.value)[0] is grpc.StatusCode.UNAVAILABLE, repr(failed.value)
        assert elapsed < SOCKET_TIMEOUT_S, f"{elapsed:.2f}s"  # the bound of one call (8.2 before: 2.2-4.4 s)
    finally:
        await client.aclose()
        cluster.stop()


def test_every_seed_needs_host_and_port():
    with pytest.raises(InvalidArgument, match="host:port"):
        connect("redis+cluster://127.0.0.1:7000,nohost")


def test_both_of_redis_py_8_2s_closed_connection_failures_are_a_connection_closed_under_a_command():
    """redis-py 8.2 names a connection closed under a command two ways: before the write, and inside it (where 8.1
    leaked the AttributeError of redis/redis-py#4287); both are retried as that (a read once), not failed. Controls:
    a refused connection, and a TypeError raised outside redis-py, are not."""
    from kvmesh.redis_client import closed_under_command

    for message in ("Connection closed by the server before write", "Connection closed by the server while writing"):
        assert closed_under_command(redis.exceptions.ConnectionError(message)), message
    assert not closed_under_command(redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:1."))
    try:
        None + 1
    except TypeError as exc:
        assert not closed_under_command(exc)
