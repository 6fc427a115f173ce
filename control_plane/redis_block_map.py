"""The block map on Redis (one server or a Redis Cluster).

Layout (docs/redis-schema.md): each live node incarnation owns a small integer
*slot*; a namespace's block map is one Redis hash ``block hash -> entries``
where an entry is 2 bytes, ``slot * 8 + tier bits``. Fencing a node is O(1):
its slot leaves the live-slot table (lookups ignore slots not in it or whose
lease expired) and a background sweep later frees the stale entries before the
slot is reused. Every check-then-modify runs as one Lua script.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from typing import Awaitable, Callable
import json
import logging
import time
import uuid
from pathlib import Path

import redis.exceptions

from kvmesh import errors
from kvmesh.namespace import Namespace
from kvmesh.redis_client import SOCKET_TIMEOUT_S, Coalescer, closed_under_command, connect
from redis.asyncio.cluster import RedisCluster

from control_plane.block_map import BlockMap
from control_plane.replica import BlockMapReplica
from kvmesh.redis_keys import Keys
from control_plane.model import (
    ALL_TIERS, Ack, AckStatus, Cleared, EventBatch, Medium, NodeInfo, NodePrefix, NodeStatus,
    PrefixMatch, Registration, Stored, joined,
)

log = logging.getLogger(__name__)

MAX_SLOTS = 8192  # entries are 2 bytes: 13 bits of slot, 3 of tiers
SWEEP_CHUNK = 1000
GC_LOCK_MS = 30_000
GC_HINT = "gc_interval_s"
CLAIM_CACHE_MAX_S = 60.0  # a namespace claim is made again at least this often per node and process
MAX_CACHED_CLAIMS = 65_536
REPLICA_WAIT_S = 0.5  # a write waits this long for this process's replica to show it (read-your-writes)
RETIRE_AFTER_S = 2 * SOCKET_TIMEOUT_S  # a dropped tenant client outlives the calls still on it  # a node may retire 16 slots (prelude.lua) per garbage collection
_SCRIPTS = ("register", "heartbeat", "deregister", "begin_batch", "end_batch", "apply", "rotate",
            "lookup", "sweep", "reap", "unlock", "claim_namespace", "release_namespace")
_NEEDS_PRELUDE = {"register", "heartbeat", "deregister", "begin_batch", "rotate", "reap"}


def _load_scripts() -> dict[str, str]:
    lua = Path(__file__).with_name("lua")
    prelude = (lua / "prelude.lua").read_text()
    out = {}
    for name in _SCRIPTS:
        body = (lua / f"{name}.lua").read_text()
        out[name] = prelude + "\n" + body if name in _NEEDS_PRELUDE else body
    return out


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# (tenant, failed_before) -> (Redis user, password, tenant epoch). failed_before: the last credentials
# were refused, e.g. because Redis restarted without an ACL file; the provider re-creates the user.
TenantCredentials = Callable[[str, bool], Awaitable[tuple[str, str, str]]]


class RedisBlockMap(BlockMap):
    """``tenant_credentials`` (tenant -> Redis ACL user and password), when given, makes every
    read and write of a tenant's block map go through that tenant's own Redis user.

    ``read_replica``: lookups answer from an in-memory :class:`BlockMapReplica` of the namespaces looked up
    (the first lookups of a namespace, and all while it resyncs, run lookup.lua). This process's own writes
    are visible to its next lookups: a write returns once its replica has applied it (or REPLICA_WAIT_S)."""

    def __init__(self, url: str, *, lease_ms: int = 10_000, key_prefix: str = "kvm",
                 username: str | None = None, password: str | None = None,
                 tenant_credentials: TenantCredentials | None = None, read_replica: bool = False,
                 namespace_release_after_ms: int = 600_000) -> None:
        self._url = url
        self._redis = connect(url, username=username, password=password)
        self._tenant_credentials = tenant_credentials
        self._tenant_clients: dict[str, tuple[object, str]] = {}  # tenant -> (client, epoch)
        self._coalescers: dict[object, Coalescer] = {}  # client -> its coalescer (single server)
        self._connecting: dict[str, asyncio.Future] = {}  # tenant -> its connection attempt in progress
        self._retiring: dict[asyncio.Task, object] = {}  # clients closed once their last calls are over
        self._refused: set[str] = set()
        self._keys = Keys(key_prefix)
        self._lease_ms = lease_ms
        self._sources = _load_scripts()
        self._sha: dict[str, str] = {}
        self._read_only_scripts = False
        # (node, namespace) -> when its claim is made again; kept for a quarter of the release's quiet time at
        # most, so no namespace is released while a process here may still write to it without claiming it
        self._known_ns: dict[tuple[str, str], float] = {}
        self._release_after_ms = namespace_release_after_ms
        self._claim_cache_s = min(CLAIM_CACHE_MAX_S, namespace_release_after_ms / 4000)
        self._next_release = 0.0
        self._replica_id = uuid.uuid4().hex
        self._cluster = isinstance(self._redis, RedisCluster)
        self.replica = (BlockMapReplica(self._redis, self._keys, client_for=self._reader)
                        if read_replica else None)

    async def _reader(self, tenant: str):
        return (await self._tenant(tenant))[0]

    async def _fenced(self) -> None:
        """After a change of the live-slot table: this process's replica shows it before the call returns."""
        if self.replica is not None:
            await self.replica.barrier(REPLICA_WAIT_S)

    # -- scripts ---------------------------------------------------------------

    async def _load(self) -> None:
        info = await self._redis.info("server")
        version = (info if "redis_version" in info else next(iter(info.values())))["redis_version"]
        # EVALSHA_RO (Redis 7) declares its keys read-only, so a tenant's Redis user needs only
        # read access to the live-slot table; before 7 the lookup runs as a plain EVALSHA.
        self._read_only_scripts = int(str(version).split(".")[0]) >= 7
        # Filled aside and published whole: concurrent first calls each see no scripts (and load them too,
        # idempotently) or all of them, never a partly filled table (that was a KeyError: INTERNAL).
        shas = {}
        for name, src in self._sources.items():
            shas[name] = await self._redis.script_load(src)
        self._sha = shas

    async def _eval(self, name: str, keys: list[str], args: list, tenant: str | None = None,
                    read_only: bool = False) -> object:
        """Runs a script, as ``tenant``'s Redis user when given (and configured). Read-only scripts on a
        single server go through the client's :class:`Coalescer` (concurrent lookups share a pipeline)."""
        if not self._sha:
            await self._load()

        def run(client):
            command = "EVALSHA_RO" if read_only and self._read_only_scripts else "EVALSHA"
            if read_only and not self._cluster:
                coalescer = self._coalescers.get(client)
                if coalescer is None:
                    coalescer = self._coalescers[client] = Coalescer(client)
                return coalescer.execute(command, self._sha[name], len(keys), *keys, *args)
            return client.execute_command(command, self._sha[name], len(keys), *keys, *args)

        for attempt in range(2):
            client, epoch = await self._tenant(tenant)
            try:
                return await run(client)
            except redis.exceptions.NoScriptError:  # the server restarted or was flushed
                await self._load()
            except (AttributeError, TypeError, redis.exceptions.ConnectionError) as exc:
                reconnects = (tenant is not None and self._tenant_credentials is not None
                              and isinstance(exc, redis.exceptions.ConnectionError))  # below
                if closed_under_command(exc) and not reconnects:
                    # Retried once when it only reads; a write may have reached Redis: the caller decides.
                    log.warning("the Redis connection closed under the %s script (%s: %s)", name,
                                type(exc).__name__, exc)
                    if not read_only or attempt:
                        raise errors.Unavailable(f"the Redis connection failed under {name}; retry") from None
                    continue
                if not isinstance(exc, redis.exceptions.ConnectionError):
                    raise
                # A tenant connection closed by Redis (its user was deleted or changed) or refused (rotated
                # password, or Redis lost its ACL users): reconnect once with fresh credentials. The epoch
                # compared is the one this call used (concurrent callers fail together: the first drops the
                # client, the others find it gone, and none may take the new epoch for a re-created tenant).
                if tenant is None or self._tenant_credentials is None or attempt:
                    raise
                self._drop_client(tenant, client)
                if isinstance(exc, redis.exceptions.AuthenticationError):
                    self._refused.add(tenant)
                if (await self._tenant(tenant))[1] != epoch:  # never touch the old tenant's keys
                    raise errors.Unavailable(f"tenant {tenant!r} was deleted and created again; retry") from None
        return await run((await self._tenant(tenant))[0])

    async def _tenant(self, tenant: str | None) -> tuple[object, str]:
        """(the client to use for ``tenant``, the tenant's epoch). Concurrent first callers share one
        connection attempt (each making its own client left all but one unclosed, and on a cluster a burst
        of them exhausted connections)."""
        if tenant is None or self._tenant_credentials is None:
            return self._redis, ""
        found = self._tenant_clients.get(tenant)
        if found is not None:
            return found
        pending = self._connecting.get(tenant)
        if pending is None:
            pending = self._connecting[tenant] = asyncio.ensure_future(self._connect_tenant(tenant))
            pending.add_done_callback(functools.partial(self._connected, tenant))
        return await asyncio.shield(pending)  # a caller that gives up leaves the others' attempt alone

    def _connected(self, tenant: str, attempt: asyncio.Future) -> None:
        self._connecting.pop(tenant, None)
        if not attempt.cancelled():
            attempt.exception()  # seen: when every caller gave up, its failure is no "never retrieved" traceback

    async def _connect_tenant(self, tenant: str) -> tuple[object, str]:
        user, password, epoch = await self._tenant_credentials(tenant, tenant in self._refused)
        self._refused.discard(tenant)
        found = self._tenant_clients[tenant] = (connect(self._url, username=user, password=password), epoch)
        return found

    def forget_tenant(self, tenant: str) -> None:
        """Drops the tenant's connection and epoch (the tenant changed); the next use reconnects."""
        found = self._tenant_clients.pop(tenant, None)
        if found is not None:
            self._retire(found[0])

    def _retire(self, client) -> None:
        """No new call uses ``client``; it is closed once the calls still on it have ended or timed out.
        Closing it at once broke them (redis-py then fails inside a closed connection: AttributeError, which
        answered INTERNAL, under `kvmesh bench load` on a cluster)."""
        self._coalescers.pop(client, None)

        async def close_later() -> None:
            await asyncio.sleep(RETIRE_AFTER_S)
            await client.aclose()

        task = asyncio.get_running_loop().create_task(close_later())
        self._retiring[task] = client
        task.add_done_callback(lambda t: self._retiring.pop(t, None))

    async def blocks_key(self, ns: Namespace) -> str:
        return self._keys.blocks(ns, (await self._tenant(ns.tenant))[1])

    def _drop_client(self, tenant: str, client: object) -> None:
        """Retires the tenant's client if it is still ``client`` (a concurrent caller may have reconnected)."""
        found = self._tenant_clients.get(tenant)
        if found is not None and found[0] is client:
            del self._tenant_clients[tenant]
            self._retire(client)

    # -- registry --------------------------------------------------------------

    def _reg_keys(self, node_id: str) -> list[str]:
        k = self._keys
        return [k.node(node_id), k.slots, k.dead_slots, k.slot_cursor]

    def _logged(self, keys: list[str]) -> list[str]:
        """``keys`` and the live-slot change stream's keys (prelude.lua's ``log_slot`` takes the last two)."""
        return [*keys, *self._keys.slot_log]

    async def register_node(self, node: NodeInfo) -> Registration:
        k = self._keys
        inc, slot, *other = await self._eval(
            "register", self._logged([*self._reg_keys(node.node_id), k.nodes, k.node_names]),
            [node.node_id, node.data_plane_address, node.pool, json.dumps(node.labels, sort_keys=True),
             self._lease_ms, MAX_SLOTS],
        )
        if int(slot) == -3:
            raise errors.AlreadyExists(
                f"node id {node.node_id!r} differs from registered node {_s(other[0])!r} only by case: a TLS "
                "certificate's names are case-insensitive, so either node's certificate would answer as the other; "
                f"name one apart (or deregister {_s(other[0])!r} first)")
        if int(slot) == -2:
            raise errors.ResourceExhausted(
                f"node {node.node_id!r} re-registered too often: its retired slots await garbage collection "
                f"(every {GC_HINT}); try again later")
        if int(slot) < 0:
            raise errors.ResourceExhausted(f"no free node slot: {MAX_SLOTS} node incarnations are live or unswept")
        await self._forget_slots(int(slot))  # a fresh slot holds nothing
        await self._fenced()
        return Registration(incarnation=int(inc), lease_ms=self._lease_ms)

    @staticmethod
    def _raise_for(reply: list, node_id: str) -> None:
        status = _s(reply[0])
        if status == "unknown":
            raise errors.NotFound(f"unknown node {node_id!r}: register it first")
        if status == "stale":
            raise errors.FailedPrecondition(
                f"stale incarnation for node {node_id!r}: current is {_s(reply[1])}; register again and resync"
            )
        if status == "expired":
            raise errors.FailedPrecondition(f"lease of node {node_id!r} expired; register again and resync")
        if status == "noslot":
            raise errors.ResourceExhausted(f"no free node slot for node {node_id!r}")
        if status == "retired":
            raise errors.ResourceExhausted(
                f"node {node_id!r} retired too many slots: they await garbage collection (every {GC_HINT})")

    async def heartbeat(self, node_id: str, incarnation: int) -> int:
        k = self._keys
        reply = await self._eval("heartbeat", self._logged([k.node(node_id), k.slots]),
                                 [incarnation, self._lease_ms])
        self._raise_for(reply, node_id)
        return self._lease_ms

    async def deregister_node(self, node_id: str, incarnation: int) -> None:
        k = self._keys
        reply = await self._eval("deregister", self._logged([k.node(node_id), k.slots, k.dead_slots, k.nodes]),
                                 [node_id, incarnation])
        self._raise_for(reply, node_id)
        await self._fenced()

    async def list_nodes(self) -> list[NodeStatus]:
        ids = sorted(_s(m) for m in await self._redis.smembers(self._keys.nodes))
        now_ms = await self._now_ms()
        out = []
        for node_id in ids:
            h = {_s(a): _s(b) for a, b in (await self._redis.hgetall(self._keys.node(node_id))).items()}
            lease = int(h.get("lease_until", "0") or 0)
            out.append(NodeStatus(
                node=NodeInfo(node_id, h.get("address", ""), h.get("pool", ""), json.loads(h.get("labels") or "{}")),
                incarnation=int(h.get("incarnation", 0)),
                live=bool(h.get("slot")) and lease >= now_ms,
                last_seq=int(h.get("last_seq", 0)),
                lease_expires_unix_ms=lease,
            ))
        return out

    async def _now_ms(self) -> int:
        sec, usec = await self._redis.time()
        return int(sec) * 1000 + int(usec) // 1000

    # -- events ------------------------------------------------------------------

    async def claim_namespace(self, node_id: str, ns: Namespace, limit: int) -> bool:
        ns_key = await self.blocks_key(ns)
        if self._known_ns.get((node_id, ns_key), 0.0) > time.monotonic():
            return True
        k = self._keys
        if not await self._eval("claim_namespace", [k.namespaces, k.tenant_namespaces(ns.tenant),
                                                    k.node_namespaces(node_id), k.namespace_claims],
                                [ns_key, limit, ns.tenant]):
            return False
        if len(self._known_ns) >= MAX_CACHED_CLAIMS:
            self._known_ns.clear()
        self._known_ns[(node_id, ns_key)] = time.monotonic() + self._claim_cache_s
        return True

    async def _begin(self, batch: EventBatch, reset: bool) -> int | Ack:
        """The sequence decision (begin_batch.lua): the slot to apply under, or the Ack to answer now."""
        reply = await self._eval("begin_batch", self._logged(self._reg_keys(batch.node_id)),
                                 [batch.incarnation, batch.seq, 1 if reset else 0, MAX_SLOTS])
        status = _s(reply[0])
        if status == "duplicate":
            return Ack(batch.seq, AckStatus.DUPLICATE)
        if status == "gap":
            return Ack(batch.seq, AckStatus.RESYNC_REQUIRED, expected_seq=int(reply[1]))
        if status != "apply":
            self._raise_for(reply, batch.node_id)
        if reset:  # a fresh slot: it holds nothing
            await self._forget_slots(int(reply[1]))
            await self._fenced()
        return int(reply[1])

    async def apply_batch(self, batch: EventBatch) -> Ack:
        k = self._keys
        slot = await self._begin(batch, batch.reset)
        if isinstance(slot, Ack):
            return slot
        tenant = batch.namespace.tenant
        ns_key = await self.blocks_key(batch.namespace)
        await self.claim_namespace(batch.node_id, batch.namespace, 0)
        hash_len = batch.namespace.cache_config.hash_algo.digest_size
        runs: list = []
        seq = 0
        held: collections.Counter[int] = collections.Counter()  # blocks each slot newly holds (or no longer: < 0)
        ours: collections.Counter[int] = collections.Counter()  # the same, of this namespace (its tenant's count)

        async def apply(slot: int) -> None:
            nonlocal seq, runs
            _, applied, added, dropped = await self._eval("apply", self._keys.change_log(ns_key),
                                                          [slot, hash_len, *runs], tenant)
            seq, runs = applied or seq, []
            held[slot] += int(added) - int(dropped)
            ours[slot] += int(added) - int(dropped)

        for event in batch.events:
            if isinstance(event, Cleared):
                if runs:
                    await apply(slot)
                cleared = slot
                slot, change = await self._clear(batch.node_id, slot, event.medium)
                held[cleared] += change
                continue
            op = "s" if isinstance(event, Stored) else "r"
            mask = event.medium.bit if event.medium is not None else ALL_TIERS
            runs += [op, mask, b"".join(event.block_hashes)]
        if runs:
            await apply(slot)
        if self.replica is not None and seq:
            await self.replica.wait_applied(ns_key, int(seq), REPLICA_WAIT_S)
        changed = [s for s in held.keys() | ours.keys() if held[s] or ours[s]]
        await self._eval("end_batch", [k.node(batch.node_id), k.slot_entries, *map(k.slot_tenant_entries, changed)],
                         [batch.incarnation, batch.seq, tenant, *(x for s in changed for x in (s, held[s], ours[s]))])
        return Ack(batch.seq, AckStatus.APPLIED, blocks_applied=batch.block_count)

    async def node_entries(self, node_id: str, tenant: str | None = None) -> int:
        k = self._keys
        slot = _s(await self._redis.hget(k.node(node_id), "slot") or "")
        if not slot:
            return 0
        if tenant is None:
            return int(await self._redis.hget(k.slot_entries, slot) or 0)
        return int(await self._redis.hget(k.slot_tenant_entries(slot), tenant) or 0)

    async def _forget_slots(self, *slots: int) -> None:
        """The entry counts of slots handed out fresh, or freed: they hold nothing."""
        k = self._keys
        await self._redis.hdel(k.slot_entries, *slots)
        await self._redis.delete(*map(k.slot_tenant_entries, slots))

    async def skip_batch(self, batch: EventBatch) -> Ack:
        decided = await self._begin(batch, reset=False)
        if isinstance(decided, Ack):
            return decided
        k = self._keys
        await self._eval("end_batch", [k.node(batch.node_id), k.slot_entries],
                         [batch.incarnation, batch.seq, batch.namespace.tenant])
        return Ack(batch.seq, AckStatus.APPLIED)

    async def _clear(self, node_id: str, slot: int, medium: Medium | None) -> tuple[int, int]:
        """AllBlocksCleared: every tier fences by rotating the slot (the new one holds nothing); one tier is
        swept. Returns the slot to go on with and the change to the entry count of ``slot``."""
        if medium is None:
            new_slot = int(await self._eval("rotate", self._logged(self._reg_keys(node_id)), [MAX_SLOTS]))
            if new_slot == -2:
                raise errors.ResourceExhausted(
                    f"node {node_id!r} retired too many slots: they await garbage collection (every {GC_HINT})")
            if new_slot < 0:
                raise errors.ResourceExhausted(f"no free node slot for node {node_id!r}")
            await self._forget_slots(new_slot)
            await self._fenced()
            return new_slot, 0
        dropped = 0
        async for ns_key in self._redis.sscan_iter(self._keys.node_namespaces(node_id)):
            lost = await self._sweep(_s(ns_key), {slot: medium.bit})
            if lost:
                await self._redis.hincrby(self._keys.slot_tenant_entries(slot), Keys.tenant_of(_s(ns_key)), -lost)
            dropped += lost
        return slot, -dropped

    async def _sweep(self, ns_key: str, clear: dict[int, int]) -> int:
        """Clears the given tier bits of the given slots from a namespace; how many blocks lost their last bit
        of a cleared slot."""
        args: list = []
        for s, mask in clear.items():
            args += [s, mask]
        cursor, dropped = "0", 0
        while True:
            reply = await self._eval("sweep", self._keys.change_log(ns_key), [cursor, SWEEP_CHUNK, *args])
            cursor, dropped = _s(reply[0]), dropped + int(reply[1])
            if cursor == "0":
                break
        if self.replica is not None and self.replica.table(ns_key) is not None:
            seq = int(await self._redis.get(Keys.block_changes_seq(ns_key)) or 0)
            await self.replica.wait_applied(ns_key, seq, REPLICA_WAIT_S)
        return dropped

    # -- lookup ------------------------------------------------------------------

    async def lookup_prefix(self, ns: Namespace, block_hashes: list[bytes], tiers: int) -> PrefixMatch:
        if not block_hashes:
            return PrefixMatch(0, [], [])
        blocks_key = await self.blocks_key(ns)
        if self.replica is not None:
            match = self.replica.lookup(blocks_key, block_hashes, tiers)
            if match is not None:
                return match
            if await self.replica.holds_blocks(blocks_key):
                self.replica.follow(blocks_key, ns.tenant)  # a namespace that never held a block is not followed
        args = [ns.cache_config.hash_algo.digest_size, joined(block_hashes), tiers]
        tenant = ns.tenant
        if self._cluster:  # the live-slot table is in another slot: fetch it concurrently
            (found,), slots, (sec, usec) = await asyncio.gather(
                self._eval("lookup", [blocks_key], args, tenant, read_only=True),
                self._read(self._redis.hgetall, self._keys.slots), self._read(self._redis.time))
            now_ms = int(sec) * 1000 + int(usec) // 1000
            by_slot = {int(slot): record for slot, record in slots.items()}
            records = [by_slot.get(slot) for slot in found[1::5]]
        else:  # one round trip: the script returns the holders' live-slot records and the time too
            found, records, now_ms = await self._eval("lookup", [blocks_key, self._keys.slots], args, tenant,
                                                      read_only=True)
        holders = []
        for i, record in zip(range(1, len(found), 5), records):
            if not record or found[i + 1] <= 0:
                continue  # not in the live-slot table (fenced), or no leading block on the filtered tiers
            node_id, _inc, lease_until, address = _s(record).split("\t", 3)
            if int(lease_until) >= now_ms:
                holders.append(NodePrefix(node_id, address, found[i + 1],
                                          {Medium.GPU: found[i + 2], Medium.CPU: found[i + 3], Medium.DISK: found[i + 4]}))
        holders.sort(key=lambda h: (-h.leading_blocks, h.node_id))
        return PrefixMatch(len(block_hashes), holders)

    @staticmethod
    async def _read(command, *args):
        """A read-only command, retried once when redis-py failed inside it (as :meth:`_eval` does)."""
        for attempt in range(2):
            try:
                return await command(*args)
            except (AttributeError, TypeError, redis.exceptions.ConnectionError) as exc:
                if not closed_under_command(exc):
                    raise
                log.warning("the Redis connection closed under a read (%s: %s)", type(exc).__name__, exc)
                if attempt:
                    raise errors.Unavailable("the Redis connection failed under a read; retry") from None

    # -- garbage -----------------------------------------------------------------

    async def collect_garbage(self) -> int:
        k = self._keys
        if not await self._redis.set(k.gc_lock, self._replica_id, nx=True, px=GC_LOCK_MS):
            return 0  # another replica is collecting; it owns slot reuse until it is done
        try:
            freed = await self._sweep_dead_slots()
            if time.monotonic() >= self._next_release:
                self._next_release = time.monotonic() + self._release_after_ms / 4000
                await self.release_empty_namespaces()
            return freed
        finally:
            await self._eval("unlock", [k.gc_lock], [self._replica_id])

    async def _sweep_dead_slots(self) -> int:
        k = self._keys
        await self._eval("reap", self._logged([k.slots, k.dead_slots]), [k.node_prefix])
        dead = [int(_s(s)) for s in await self._redis.smembers(k.dead_slots)]
        if not dead:
            return 0
        clear = {s: ALL_TIERS for s in dead}
        async for ns_key in self._redis.sscan_iter(k.namespaces):
            await self._sweep(_s(ns_key), clear)
            await self._redis.pexpire(k.gc_lock, GC_LOCK_MS)
        await self._forget_slots(*dead)  # before the slots can be handed out again
        await self._redis.srem(k.dead_slots, *dead)
        pipe = self._redis.pipeline(transaction=False)
        for node_id in await self._redis.smembers(k.nodes):  # their retired slots are swept: allow more
            pipe.hset(k.node(_s(node_id)), "retired", 0)
        await pipe.execute()
        return len(dead)

    async def release_empty_namespaces(self) -> int:
        """Namespaces whose block map is empty and that no node claimed for ``namespace_release_after_ms`` stop
        counting against their tenant's namespace limit (release_namespace.lua): the made-up models of a node
        key are given back once their blocks are gone (its lease ran out, its key revoked). Returns how many."""
        k = self._keys
        now_ms = await self._now_ms()
        cutoff = now_ms - self._release_after_ms
        quiet: list[tuple[str, str]] = []  # (block-map key, tenant) claimed last before the cutoff
        claimed: set[str] = set()
        async for ns_key, claim in self._redis.hscan_iter(k.namespace_claims):
            claimed.add(_s(ns_key))
            claimed_ms, _, tenant = _s(claim).partition("\t")
            if int(claimed_ms) < cutoff:
                quiet.append((_s(ns_key), tenant))
        await self._claim_unclaimed(now_ms, claimed)
        released, node_sets = 0, None
        for start in range(0, len(quiet), SWEEP_CHUNK):
            chunk = quiet[start:start + SWEEP_CHUNK]
            pipe = self._redis.pipeline(transaction=False)
            for ns_key, _ in chunk:
                pipe.exists(ns_key)
            for (ns_key, tenant), held in zip(chunk, await pipe.execute()):
                if held:
                    continue
                if node_sets is None:
                    node_sets = [k.node_namespaces(_s(n)) for n in await self._redis.smembers(k.nodes)]
                released += int(await self._eval("release_namespace", [
                    k.namespace_claims, k.tenant_namespaces(tenant), k.namespaces, *node_sets],
                    [ns_key, self._release_after_ms]))
            await self._redis.pexpire(k.gc_lock, GC_LOCK_MS)
        return released

    async def _claim_unclaimed(self, now_ms: int, claimed: set[str]) -> int:
        """Namespaces on the sweep's list without a claim (written before claims were recorded: an upgraded
        map) get one dated now, so they too are released once empty and quiet instead of counting against their
        tenant for good. ``claimed``: the namespaces with a claim just read (HSETNX keeps any made since).
        Returns how many."""
        k = self._keys
        listed = [_s(key) async for key in self._redis.sscan_iter(k.namespaces)]
        listed = [key for key in listed if "{t:" in key and key not in claimed]
        stamped = 0
        for start in range(0, len(listed), SWEEP_CHUNK):
            pipe = self._redis.pipeline(transaction=False)
            for ns_key in listed[start:start + SWEEP_CHUNK]:
                pipe.hsetnx(k.namespace_claims, ns_key, f"{now_ms}\t{Keys.tenant_of(ns_key)}")
            stamped += sum(int(added) for added in await pipe.execute())
        if stamped:
            log.info("%d namespaces had no claim on record (written by an earlier version): claimed now, so each is "
                     "released once empty for namespace_release_after_s", stamped)
        return stamped

    async def count_new(self, ns: Namespace, block_hashes: list[bytes]) -> tuple[int, int]:
        """(entries the namespace has, how many of ``block_hashes`` it lacks), as the tenant."""
        client, epoch = await self._tenant(ns.tenant)
        key = self._keys.blocks(ns, epoch)
        pipe = client.pipeline(transaction=False)
        pipe.hlen(key)
        pipe.hmget(key, block_hashes)
        size, present = await pipe.execute()
        return int(size), sum(1 for v in present if v is None)

    async def close(self) -> None:
        if self.replica is not None:
            await self.replica.close()
        for task, client in list(self._retiring.items()):
            task.cancel()
            await client.aclose()
        for client, _epoch in self._tenant_clients.values():
            await client.aclose()
        self._tenant_clients.clear()
        await self._redis.aclose()
