"""Verified API keys cached in process, with revocation pushed from Redis.

Reading a key record from Redis on every RPC costs one round trip per call
(about as much as the RPC itself). :class:`KeyCache` keeps the records it has
read and drops one as soon as the tenant store announces a change to it on the
revocation channel (Redis pub/sub, see :meth:`tenancy.store.RedisTenantStore.
publish_change`). :class:`ChangeListener` holds the subscription.

The bound, stated once: a revoked key is refused by every replica as soon as the
notification reaches it (milliseconds), and in every case within ``ttl_s``:

- Redis pub/sub is at-most-once; a message is lost only when the subscriber's
  connection drops. While the listener is not subscribed the cache is bypassed
  (every call reads Redis, as without a cache), and every entry is dropped when
  it subscribes again, so a message missed during an outage cannot leave a stale
  entry behind.
- A record read concurrently with its revocation could be cached after the
  notification ran: a change counter makes such a read uncacheable.
- Whatever else goes wrong, an entry expires ``ttl_s`` after it was read.

Threading model: one event loop; no locks needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

KEY_CHANGE = "key:"
TENANT_CHANGE = "tenant:"


class KeyCache(Generic[T]):
    """Caches ``get(key_id)`` results that are not None, while ``live()`` says notifications flow."""

    def __init__(self, get: Callable[[str], Awaitable[T | None]], ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._get = get
        self._ttl = ttl_s
        self._clock = clock
        self._entries: dict[str, tuple[float, T]] = {}
        self._changes = 0
        self.live = False  # set by the listener while it is subscribed

    async def get(self, key_id: str) -> T | None:
        now = self._clock()
        hit = self._entries.get(key_id)
        if hit is not None and self.live and now - hit[0] < self._ttl:
            return hit[1]
        changes = self._changes
        value = await self._get(key_id)
        if value is not None and self.live and self._ttl > 0 and changes == self._changes:
            self._entries[key_id] = (now, value)
        else:
            self._entries.pop(key_id, None)
        return value

    def drop(self, key_id: str) -> None:
        self._changes += 1
        self._entries.pop(key_id, None)

    def clear(self) -> None:
        self._changes += 1
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


Subscribe = Callable[[], Awaitable[object]]  # -> a connected redis.asyncio PubSub, subscribed


class ChangeListener:
    """Follows the store's change channel: ``key:<id>`` drops a cached key, ``tenant:<id>`` a cached
    tenant (``on_tenant``). Marks ``cache.live`` only while subscribed; reconnects with backoff."""

    def __init__(self, subscribe: Subscribe, cache: KeyCache, on_tenant: Callable[[str], None] | None = None,
                 retry_s: float = 1.0) -> None:
        self._subscribe = subscribe
        self._cache = cache
        self._on_tenant = on_tenant
        self._retry_s = retry_s
        self._task: asyncio.Task | None = None
        self.subscribed = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvmesh-key-changes")

    async def _run(self) -> None:
        while True:
            pubsub = None
            try:
                pubsub = await self._subscribe()
                self._cache.clear()
                self._cache.live = True
                self.subscribed.set()
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None:
                        self._apply(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis down: bypass the cache until resubscribed
                log.warning("key revocation feed lost (%s); reading keys from Redis until it is back",
                            type(exc).__name__)
            finally:
                self._cache.live = False
                self.subscribed.clear()
                self._cache.clear()
                if pubsub is not None:
                    try:
                        await pubsub.aclose()
                    except Exception:  # noqa: BLE001 - closing a broken connection
                        pass
            await asyncio.sleep(self._retry_s)

    def _apply(self, data) -> None:
        change = data.decode() if isinstance(data, bytes) else str(data)
        if change.startswith(KEY_CHANGE):
            self._cache.drop(change[len(KEY_CHANGE):])
        elif change.startswith(TENANT_CHANGE):
            if self._on_tenant is not None:
                self._on_tenant(change[len(TENANT_CHANGE):])
        else:  # unknown change: be safe
            self._cache.clear()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
