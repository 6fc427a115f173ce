"""Connects to the block-map store: one Redis, or a Redis Cluster.

``redis://host:port/db`` (or ``rediss://``) is a single server;
``redis+cluster://host:port`` (or ``rediss+cluster://``) is a cluster reached
through any of its nodes. Both give a ``redis.asyncio`` client with the same
commands; kvmesh keys carry hash tags so every multi-key script stays in one slot.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from kvmesh.errors import InvalidArgument

SOCKET_TIMEOUT_S = 2.0


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
            plain = url.replace("+cluster", "", 1)
            return RedisCluster.from_url(plain, **kwargs)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return aioredis.Redis.from_url(url, **kwargs)
    raise InvalidArgument(f"redis url {redacted(url)!r} must start with redis://, rediss://, unix:// or "
                          "redis+cluster://")
