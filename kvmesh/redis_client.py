"""Connects to the block-map store: one Redis, or a Redis Cluster.

``redis://host:port/db`` (or ``rediss://``) is a single server;
``redis+cluster://host:port[,host:port...]`` (or ``rediss+cluster://``) is a
cluster reached through any of the nodes listed (name several: a client that
must rediscover the cluster after its first node died asks the others). Both
give a ``redis.asyncio`` client with the same commands; kvmesh keys carry hash
tags so every multi-key script stays in one slot.
:class:`Coalescer` pipelines the commands concurrent callers issue in one event-loop turn.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvmesh.errors import InvalidArgument

SOCKET_TIMEOUT_S = 2.0
# A cluster client retries a command that failed on a connection (a refreshed topology may route it elsewhere) this
# many times, at once: redis-py 8.2 spaces the retries by a backoff (8.1 did not), which held a command whose primary
# had died 2-4 s, past SOCKET_TIMEOUT_S, and could carry a replica's read across a failover unseen (a replica
# resyncs after a connection error: control_plane.replica).
CLUSTER_RETRIES = 10

_CONNECTION_FAILED = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
# redis-py 8.2 raises this when no node of a cluster answers (None before 8.2).
_CLUSTER_UNREACHABLE = getattr(redis.exceptions, "RedisClusterUnreachableError", None)


def unavailable(exc: BaseException) -> bool:
    """Redis, or every node of a cluster, could not be reached or did not answer in time: the store is unavailable
    (callers may retry), not a bug. redis-py 8.2 tells a cluster no node of which answers with
    RedisClusterUnreachableError, not a ConnectionError (its cluster client also ends with it when a connection keeps
    closing under a command); before 8.2 that was a plain RedisClusterException raised from the connection error (the
    rule 8.2 applies: not from a refused login)."""
    if isinstance(exc, _CONNECTION_FAILED):
        return True
    if _CLUSTER_UNREACHABLE is not None:
        return isinstance(exc, _CLUSTER_UNREACHABLE)
    cause = exc.__cause__
    return (isinstance(exc, redis.exceptions.RedisClusterException)
            and isinstance(cause, (*_CONNECTION_FAILED, OSError))
            and not isinstance(cause, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)))


def closed_under_command(exc: BaseException) -> bool:
    """A connection closed under a command in flight: a transient failure of the connection, not a bug of the
    caller. redis-py 8.1 then failed inside itself (an AttributeError or TypeError writing to a writer that is
    gone: redis/redis-py#4287); 8.2 raises ConnectionError("Connection closed by the server before write"), or
    "... while writing" for that same failure inside the write."""
    if isinstance(exc, redis.exceptions.ConnectionError):
        return str(exc).startswith(("Connection closed by the server before write",
                                    "Connection closed by the server while writing"))
    if not isinstance(exc, (AttributeError, TypeError)):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").split(".")[0] == "redis"


def redacted(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and messages)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


def connect(url: str, username: str | None = None, password: str | None = None):
    """An asyncio client for ``url``; credentials override those in the URL."""
    kwargs = dict(socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S)
    if username is not None:
        kwargs["username"] = username
    if password is not None:
        kwargs["password"] = password
    for scheme in ("redis+cluster://", "rediss+cluster://"):
        if url.startswith(scheme):
            return _cluster(url, kwargs)
    if url.startswith(("redis://", "rediss://", "unix://")):
        _check_server_url(url)
        return aioredis.Redis.from_url(url, **kwargs)
    raise InvalidArgument(f"{SETTING} {redacted(url)!r} is not a Redis URL; give redis://host:port/db (or "
                          "rediss://, unix://, redis+cluster://host:port[,host:port...])")


# The setting a Redis URL comes from, as its errors name it (the control plane's).
SETTING = "redis_url (--redis-url / KVMESH_CP_REDIS_URL)"


def _bad(url: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{SETTING} {redacted(url)!r}: {why}")


def _port(url: str, port: str) -> int:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise _bad(url, f"port {port!r} is not a number in 1..65535; give host:port")
    return int(port)


def _check_db(url: str, path: str, cluster: bool = False) -> None:
    db = path.strip("/")
    if cluster and db not in ("", "0"):
        raise _bad(url, f"a Redis Cluster has only database 0; drop '/{db}' from the URL")
    if not db.isdigit() and db:
        raise _bad(url, f"the database {db!r} is not a number; give redis://host:port/0 (or another database number)")


def _check_server_url(url: str) -> None:
    """What redis-py would misread in a single server's URL: a port that is not a number (its error names no
    setting), a database that is not one (it quietly uses 0), a unix:// URL without a socket path. (Parsed as
    redis-py parses it: a password holding ``/``, ``?``, ``#`` or ``@`` must be percent-encoded.)"""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise _bad(url, "no socket path; give unix:///path/to/redis.sock")
        return
    host, colon, port = parts.netloc.rpartition("@")[2].rpartition(":")
    if colon and (not host.startswith("[") or host.endswith("]")):  # not a bare IPv6 address
        _port(url, port)
    _check_db(url, parts.path)


class Coalescer:
    """Pipelines concurrent callers' commands: one pipeline in flight at a time; what callers issue meanwhile
    goes out together as the next one, as soon as it returns.

    redis-py costs a caller ~70 µs of CPU per command (a pooled connection, packing, a timed send and read, one
    write and one read syscall each) and ~15 µs per pipelined one. Under load many lookups are in flight at
    once, and they arrive one event-loop turn apart; batching what accumulates during a round trip makes one
    write and one read for many (measured: docs/architecture.md, "Load and soak"). A lone caller pays one
    event-loop turn; under load a caller waits at most for the round trip in flight. Each caller gets its own
    reply or its own error: a pipeline is not a transaction, and nothing but the socket is shared. A caller
    that gives up (cancelled) leaves the others alone. Single servers only: a cluster pipeline routes by key
    slot.

    One bound per caller: ``timeout_s`` (the socket timeout) from the moment it calls :meth:`execute`, whether
    its command is still queued behind a pipeline that hangs (a frozen server) or on the wire; then it gets
    :class:`redis.exceptions.TimeoutError`, as from a socket timeout. Without it a caller queued behind a stuck
    pipeline waited for that pipeline's timeout and then its own (twice the bound). A command whose caller's
    bound ran out before it was sent is not sent.

    Threading model: one event loop.
    """

    def __init__(self, client: aioredis.Redis, timeout_s: float = SOCKET_TIMEOUT_S) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._pending: list[tuple[asyncio.Future, tuple]] = []
        self._sending: asyncio.Task | None = None

    def execute(self, *args) -> asyncio.Future:
        """``args`` as ``execute_command`` takes them; the future holds the reply (or raises its error)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        expiry = loop.call_later(self._timeout_s, _expire, future, self._timeout_s)
        future.add_done_callback(lambda _: expiry.cancel())
        self._pending.append((future, args))
        if len(self._pending) == 1 and self._sending is None:
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        if self._sending is not None or not self._pending:
            return  # the pipeline in flight flushes what is pending when it returns
        batch, self._pending = self._pending, []
        self._sending = asyncio.get_running_loop().create_task(self._send(batch))  # held: tasks are weakly kept
        self._sending.add_done_callback(self._sent)

    def _sent(self, _task: asyncio.Task) -> None:
        self._sending = None
        self._flush()

    async def _send(self, batch: list[tuple[asyncio.Future, tuple]]) -> None:
        batch = [(future, args) for future, args in batch if not future.done()]  # expired or gone: not sent
        if not batch:
            return
        try:
            if len(batch) == 1:
                replies = [await self._client.execute_command(*batch[0][1])]
            else:
                pipe = self._client.pipeline(transaction=False)
                for _, args in batch:
                    pipe.execute_command(*args)
                replies = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - the connection failed: every caller of the batch sees it
            for future, _ in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # cancelled (the loop is closing): release the callers, then go
            for future, _ in batch:
                future.cancel()
            raise
        for (future, _), reply in zip(batch, replies):
            if future.done():  # the caller gave up
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)


def _expire(future: asyncio.Future, timeout_s: float) -> None:
    if not future.done():
        future.set_exception(redis.exceptions.TimeoutError(
            f"no reply from Redis within {timeout_s:g}s (queued and sent, in all)"))


def _cluster(url: str, kwargs: dict) -> RedisCluster:
    """A cluster client seeded with every node ``url`` (``redis+cluster://`` or ``rediss+cluster://``) lists (the
    first one carries the URL's options)."""
    parts = urlsplit(url.replace("+cluster", "", 1))
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not hosts.strip(","):
        raise _bad(url, "names no node; give redis+cluster://host:port[,host:port...]")
    seeds = []
    for host in hosts.split(","):
        name, colon, port = host.rpartition(":")
        if not colon or not name:
            raise _bad(url, f"node {host!r} is not host:port; every node must be host:port")
        seeds.append(ClusterNode(name, _port(url, port)))
    _check_db(url, parts.path, cluster=True)
    first = urlunsplit(parts._replace(netloc=f"{userinfo}{at}{hosts.split(',')[0]}"))
    return RedisCluster.from_url(first, startup_nodes=seeds[1:] or None, retry=Retry(NoBackoff(), CLUSTER_RETRIES),
                                 **kwargs)
