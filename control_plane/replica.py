"""An in-memory read replica of the block map, fed by Redis change streams; Redis stays the source of truth.

Every script that changes a namespace's block map (apply.lua, sweep.lua) appends a compact record to that
namespace's change stream under the next sequence number (stream id ``<seq>-0``, same hash tag as the map: one
cluster slot); every change of the live-slot table is appended to the slot change stream (prelude.lua's
``log_slot``). A replica:

- loads a namespace (HSCAN of its hash, after reading its sequence counter) the first time it is asked about
  it (:meth:`follow`) or all namespaces at once (:meth:`resync`), and the live-slot table (HGETALL);
- then follows each stream from the sequence it loaded at, one task per stream (``XREAD BLOCK``), replaying each
  record on its tables exactly as the script changed Redis;
- resyncs a stream (reload, then follow again) on a gap (the stream was trimmed past its last sequence, or the
  counter went back: Redis restarted or failed over to a replica that was behind) and after any connection
  error; while a namespace resyncs :meth:`lookup` answers None and the caller asks Redis (lookup.lua).

Fencing holds as in lookup.lua: entries of slots not in the live-slot table, or whose lease has expired by the
Redis clock (the replica keeps Redis's clock offset), are not returned. A replica is behind Redis by its lag
(``lag_ms``): a stale holder costs at most a MISS at that source, which the data plane already answers.

Memory: see control_plane.replica_table (12 bytes a table slot, in buckets of 4; 24-48 bytes a block; values
interned).

Threading model: one event loop. :meth:`lookup` and the other reads are synchronous and never await. A follower
gives the loop back between records every REPLAY_SLICE_S, and grows a table (a rehash of every block) in a worker
thread into a copy it then swaps in; it is each table's only writer, so readers meanwhile read the old one whole.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from kvmesh.redis_client import connect, unavailable
from kvmesh.redis_keys import Keys

from control_plane.model import ALL_TIERS, PrefixMatch
from control_plane.replica_table import BlockTable, SlotRecord, Values, block_keys, packed, prefix_match

log = logging.getLogger(__name__)

BLOCK_MS = 1000  # one XREAD waits this long for changes (below the client's socket timeout)
READ_COUNT = 1024  # stream records per XREAD
# Replaying records gives the event loop back after this long: 1,024 records of 512 blocks each took 1.6 s, during
# which no lookup was answered and other coroutines' Redis reads passed their 2 s socket timeout.
REPLAY_SLICE_S = 0.01
_RECORD_FIELDS = (b"t", b"ms", b"s", b"hl")  # a namespace record's fields other than its runs of blocks
SCAN_COUNT = 10_000  # hash fields per HSCAN while loading
CLOSE_WAIT_S = 2.0
RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)  # backoff after a failed read or load
# Namespaces a lookup or a watch may start following (each holds a blocking Redis read, so a Redis connection, until
# the block map releases it: RELEASE_CHECK_S): past this, lookups of namespaces not followed yet are answered from
# Redis. Unbounded, lookups of made-up models held one Redis connection each (Redis serves 10,000 clients at most,
# for the whole fleet); lookups now follow only namespaces that hold blocks (the block map's namespace set), a watch
# any it may read.
MAX_FOLLOWED_NAMESPACES = 1024
# Of which one tenant's lookups and watches may take this many: a tenant following made-up (or many) namespaces
# takes its own share, never the other tenants' (theirs would all go to Redis).
MAX_FOLLOWED_PER_TENANT = 128
# A followed namespace the block map no longer lists (released once empty, after namespace_release_after_s, or its
# tenant deleted) and nobody watches is given up: its follow counts again for its tenant. Checked this often, only
# while the namespace is empty here (or its follower fails: a deleted tenant's reads do); given up when two checks in
# a row find it unlisted (a Redis that lost its data lists nothing until its writers claim their namespaces again).
RELEASE_CHECK_S = 10.0

ClientFor = Callable[[str], Awaitable[object]]  # tenant -> the Redis client to read its keys with


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _seq(stream_id) -> int:
    return int(_s(stream_id).split("-", 1)[0])


class Change:
    """What a namespace's subscribers learn after each record: the keys whose value may have changed
    (None: every key, after a load)."""

    __slots__ = ("keys",)

    def __init__(self, keys: np.ndarray | None) -> None:
        self.keys = keys


@dataclass
class _Stream:
    """One followed stream: its sequence, whether it is in sync, and its follower task."""

    key: str
    seq: int = 0
    synced: bool = False
    task: asyncio.Task | None = None
    applied: asyncio.Event = field(default_factory=asyncio.Event)  # set after each applied record


@dataclass
class _Namespace(_Stream):
    blocks_key: str = ""
    tenant: str = ""
    table: BlockTable | None = None
    subscribers: list[asyncio.Queue] = field(default_factory=list)
    release_checked: float = 0.0  # when it was last asked whether the block map still lists this namespace
    unlisted: bool = False  # the last time asked, it did not


class BlockMapReplica:
    """The block map in memory, for lookups without a Redis round trip (see the module docstring).

    ``redis``: the client for the live-slot table and the namespace list. ``client_for`` (optional): the client
    to read a tenant's namespaces with (its own Redis ACL user); default ``redis``."""

    def __init__(self, redis, keys: Keys, *, client_for: ClientFor | None = None) -> None:
        self._redis = redis
        self._keys = keys
        self._client_for = client_for
        self._values = Values()
        self._slots: dict[int, SlotRecord] = {}
        self._slot_stream = _Stream(keys.slot_changes)
        self._namespaces: dict[str, _Namespace] = {}
        self._followed_of: collections.Counter[str] = collections.Counter()  # tenant -> namespaces followed
        self._slot_subscribers: list[asyncio.Queue] = []
        self._clock_offset_ms = 0  # Redis clock minus this host's
        self._started = False
        self._closing = False
        self.resyncs = 0  # loads after a gap or a failure (not the first load of a stream)
        self.lag_ms: collections.deque[float] = collections.deque(maxlen=10_000)  # per applied record
        self._owned_redis = False

    @classmethod
    def from_url(cls, url: str, *, key_prefix: str = "kvm", username: str | None = None,
                 password: str | None = None) -> "BlockMapReplica":
        """A replica reading everything with one Redis user (e.g. for a benchmark or an admin tool)."""
        replica = cls(connect(url, username=username, password=password), Keys(key_prefix))
        replica._owned_redis = True
        return replica

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Starts following the live-slot table (namespaces are followed from :meth:`follow` / :meth:`resync`)."""
        if not self._started:
            self._started = True
            self._slot_stream.task = asyncio.ensure_future(self._follow(self._slot_stream))

    async def close(self) -> None:
        self._closing = True
        streams = [self._slot_stream, *self._namespaces.values()]
        tasks = [s.task for s in streams if s.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:  # a follower cancelled inside a cluster client's command may take a moment to unwind
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        if self._owned_redis:
            await self._redis.aclose()

    async def resync(self) -> int:
        """Loads the live-slot table and every namespace listed in Redis (the block map's namespace set), and
        follows them all; returns the number of blocks held."""
        self.start()
        await self._load_slots(self._slot_stream)
        keys = [_s(k) async for k in self._redis.sscan_iter(self._keys.namespaces, count=1000)]
        for blocks_key in keys:
            state = self._namespace(blocks_key, Keys.tenant_of(blocks_key))
            await self._load_namespace(state)
            self._ensure_task(state)
        return self.block_count()

    def follow(self, blocks_key: str, tenant: str | None = None) -> bool:
        """Starts loading and following the namespace at ``blocks_key`` (idempotent); False when it is not followed
        and will not be: MAX_FOLLOWED_NAMESPACES are, or MAX_FOLLOWED_PER_TENANT of its tenant (its lookups go
        to Redis)."""
        tenant = tenant or Keys.tenant_of(blocks_key)
        if blocks_key not in self._namespaces and (len(self._namespaces) >= MAX_FOLLOWED_NAMESPACES or
                                                   self._followed_of[tenant] >= MAX_FOLLOWED_PER_TENANT):
            return False
        self.start()
        self._ensure_task(self._namespace(blocks_key, tenant))
        return True

    async def holds_blocks(self, blocks_key: str) -> bool:
        """Is the namespace followed, or listed in the block map's namespace set (it holds blocks: a batch claimed
        it, and it was not released since)? What a lookup checks before it follows a namespace."""
        return blocks_key in self._namespaces or bool(await self._redis.sismember(self._keys.namespaces, blocks_key))

    def follows(self, blocks_key: str) -> bool:
        """Is the namespace followed (loading or in sync)?"""
        return blocks_key in self._namespaces

    def in_sync(self, blocks_key: str) -> bool:
        state = self._namespaces.get(blocks_key)
        return state is not None and state.synced and self._slot_stream.synced

    async def wait_synced(self, blocks_key: str, timeout_s: float) -> bool:
        """Follows the namespace and waits until it is in sync (False: not within ``timeout_s``, or it cannot be
        followed)."""
        if not self.follow(blocks_key):
            return False
        deadline = time.monotonic() + timeout_s
        while not self.in_sync(blocks_key):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    async def wait_applied(self, blocks_key: str, seq: int, timeout_s: float) -> bool:
        """Waits until the namespace's record ``seq`` is applied here (read-your-writes for this process);
        True at once when the namespace is not followed or is loading (its lookups go to Redis meanwhile: a
        write never waits for the load of a large namespace). False: not within ``timeout_s``."""
        state = self._namespaces.get(blocks_key)
        if state is None or not seq or not state.synced:
            return True
        deadline = time.monotonic() + timeout_s
        while state.seq < seq and state.synced:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            state.applied.clear()
            try:
                await asyncio.wait_for(state.applied.wait(), remaining)
            except asyncio.TimeoutError:
                return False
        return True

    async def barrier(self, timeout_s: float) -> bool:
        """Waits until every live-slot change made so far is applied here (fencing is then visible)."""
        stream = self._slot_stream
        if not self._started or not stream.synced:
            return True  # not following, or loading (every lookup goes to Redis until it is done)
        seq = int(await self._redis.get(self._keys.slot_changes_seq) or 0)
        deadline = time.monotonic() + timeout_s
        while stream.seq < seq and stream.synced:
            if time.monotonic() >= deadline:
                return False
            stream.applied.clear()
            try:
                await asyncio.wait_for(stream.applied.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                return False
        return True

    # -- reads ------------------------------------------------------------------------

    def lookup(self, blocks_key: str, block_hashes: list[bytes], tiers: int = ALL_TIERS) -> PrefixMatch | None:
        """lookup.lua's answer from memory: the live holders of the longest prefix of ``block_hashes`` on the
        tiers in mask ``tiers``; None while the namespace is not in sync (ask Redis)."""
        if not self.in_sync(blocks_key):
            return None
        if not block_hashes:
            return PrefixMatch(0, [])
        counts = self._namespaces[blocks_key].table.leading(*packed(block_hashes), tiers)
        return prefix_match(counts, self._slots, self.now_ms(), len(block_hashes))

    def now_ms(self) -> int:
        """This host's estimate of Redis's clock (leases are in Redis time)."""
        return int(time.time() * 1000) + self._clock_offset_ms

    def block_count(self) -> int:
        return sum(len(s.table) for s in self._namespaces.values() if s.table is not None)

    def memory_bytes(self) -> int:
        """Bytes held by the tables and the interned values (the arrays' sizes; Python overhead of the
        per-namespace bookkeeping not included)."""
        return sum(s.table.nbytes() for s in self._namespaces.values() if s.table is not None) + self._values.nbytes()

    def table(self, blocks_key: str) -> BlockTable | None:
        state = self._namespaces.get(blocks_key)
        return state.table if state is not None else None

    @property
    def values(self) -> Values:
        return self._values

    @property
    def slots(self) -> dict[int, SlotRecord]:
        """The live-slot table as this replica has it (slot -> record)."""
        return self._slots

    def subscribe(self, blocks_key: str, queue: asyncio.Queue) -> None:
        """``queue`` receives a :class:`Change` after each change of the namespace (a load: ``keys`` None)."""
        self.follow(blocks_key)
        self._namespaces[blocks_key].subscribers.append(queue)

    def unsubscribe(self, blocks_key: str, queue: asyncio.Queue) -> None:
        state = self._namespaces.get(blocks_key)
        if state is not None and queue in state.subscribers:
            state.subscribers.remove(queue)

    def slot_subscribe(self, queue: asyncio.Queue) -> None:
        """``queue`` receives the list of slots changed after each live-slot change (None: after a load)."""
        self._slot_subscribers.append(queue)

    def slot_unsubscribe(self, queue: asyncio.Queue) -> None:
        if queue in self._slot_subscribers:
            self._slot_subscribers.remove(queue)

    # -- following ---------------------------------------------------------------------

    def _namespace(self, blocks_key: str, tenant: str) -> _Namespace:
        state = self._namespaces.get(blocks_key)
        if state is None:
            self._followed_of[tenant] += 1
            state = self._namespaces[blocks_key] = _Namespace(Keys.block_changes(blocks_key), blocks_key=blocks_key,
                                                             tenant=tenant)
        return state

    def _ensure_task(self, state: _Namespace) -> None:
        if state.task is None and not self._closing:
            state.task = asyncio.ensure_future(self._follow(state))

    async def _client(self, stream: _Stream):
        if isinstance(stream, _Namespace) and self._client_for is not None:
            return await self._client_for(stream.tenant)
        return self._redis

    async def _follow(self, stream: _Stream) -> None:
        """Loads the stream's state when not in sync, then replays its records until closed or cancelled."""
        failures = 0
        while not self._stopping():
            try:
                client = await self._client(stream)
                if not stream.synced:
                    if isinstance(stream, _Namespace):
                        await self._load_namespace(stream)
                    else:
                        await self._load_slots(stream)
                reply = await client.xread({stream.key: f"{stream.seq}-0"}, count=READ_COUNT, block=BLOCK_MS)
                failures = 0
                if not reply:
                    await self._idle(client, stream)
                    if isinstance(stream, _Namespace) and stream.table is not None:
                        if len(stream.table):
                            stream.unlisted = False  # holds blocks: a check before does not count
                        elif await self._given_up(stream):
                            return
                    continue
                slice_ends = time.perf_counter() + REPLAY_SLICE_S
                for _key, records in reply:
                    for stream_id, fields in records:
                        seq = _seq(stream_id)
                        if seq <= stream.seq and stream.synced:  # a load (resync) ran meanwhile and holds it
                            continue
                        if seq != stream.seq + 1 or not stream.synced:
                            if stream.synced:
                                log.warning("change stream %s: got %d after %d (trimmed past this replica, or "
                                            "Redis lost changes); resyncing", stream.key, seq, stream.seq)
                            self._out_of_sync(stream)
                            break
                        if isinstance(stream, _Namespace):
                            await self._make_room(stream, fields)
                        self._apply(stream, fields)
                        stream.seq = seq
                        if time.perf_counter() >= slice_ends:  # a record is whole: others may run between two
                            await asyncio.sleep(0)
                            slice_ends = time.perf_counter() + REPLAY_SLICE_S
                    if stream.synced:
                        stream.applied.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a follower survives Redis outages and failovers
                if self._stopping():  # cancelled inside a Redis call that answered with its own error
                    return
                if not failures:  # once per run of failures (a tenant deleted meanwhile fails until closed)
                    log.warning("change stream %s: %s; resyncing", stream.key, exc,
                                exc_info=not (unavailable(exc) or isinstance(exc, OSError)))
                self._out_of_sync(stream)
                if isinstance(stream, _Namespace) and await self._given_up(stream):
                    return
                await asyncio.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
                failures += 1

    async def _given_up(self, state: _Namespace) -> bool:
        """Stops following ``state``'s namespace if the block map did not list it at two checks in a row and nobody
        watches it (asked at most every RELEASE_CHECK_S): it then counts for nothing, and a lookup follows it again
        once it holds blocks. The caller, its follower, returns when True."""
        now = time.monotonic()
        if state.subscribers or now - state.release_checked < RELEASE_CHECK_S:
            return False
        state.release_checked = now
        try:
            listed = await self._redis.sismember(self._keys.namespaces, state.blocks_key)
        except Exception:  # noqa: BLE001 - Redis unreachable: keep following, ask again later
            return False
        if listed or not state.unlisted:
            state.unlisted = not listed
            return False
        if state.subscribers or self._namespaces.get(state.blocks_key) is not state:
            return False
        del self._namespaces[state.blocks_key]
        self._followed_of[state.tenant] -= 1
        if self._followed_of[state.tenant] <= 0:
            del self._followed_of[state.tenant]
        log.info("namespace %s is no longer in the block map: not followed any more", state.blocks_key)
        return True

    def _stopping(self) -> bool:
        """Closed, or this follower's task cancelled: a cancellation that lands inside a Redis call can come
        back as that call's error (redis-py's read timeout makes it a TimeoutError), or as nothing."""
        return self._closing or asyncio.current_task().cancelling() > 0

    def _out_of_sync(self, stream: _Stream) -> None:
        if stream.synced:
            self.resyncs += 1
        stream.synced = False

    async def _idle(self, client, stream: _Stream) -> None:
        """No record within BLOCK_MS: a counter behind this replica means Redis lost changes (a restart
        without persistence, a failover to a lagging replica): resync. Also refreshes the clock offset."""
        key = (Keys.block_changes_seq(stream.blocks_key) if isinstance(stream, _Namespace)
               else self._keys.slot_changes_seq)
        if int(await client.get(key) or 0) < stream.seq:
            log.warning("change stream %s: the counter went back; resyncing", stream.key)
            self._out_of_sync(stream)
        if not isinstance(stream, _Namespace):
            await self._measure_clock()

    async def _measure_clock(self) -> None:
        before = time.time()
        sec, usec = await self._redis.time()
        after = time.time()
        self._clock_offset_ms = int(sec) * 1000 + int(usec) // 1000 - int((before + after) * 500)

    async def _load_slots(self, stream: _Stream) -> None:
        seq = int(await self._redis.get(self._keys.slot_changes_seq) or 0)
        records = await self._redis.hgetall(self._keys.slots)
        await self._measure_clock()
        self._slots = {int(_s(slot)): SlotRecord.parse(record) for slot, record in records.items()}
        stream.seq, stream.synced = seq, True
        stream.applied.set()
        for queue in self._slot_subscribers:
            queue.put_nowait(None)

    async def _load_namespace(self, state: _Namespace) -> None:
        """Sequence first, then the hash: every change after that sequence is replayed on top of the scan, so
        a change the scan saw or missed ends the same (records set or clear bits; the last one wins)."""
        client = await self._client(state)
        seq = int(await client.get(Keys.block_changes_seq(state.blocks_key)) or 0)
        # sized for what the hash holds now: growing on the way rehashed every block loaded so far, in the loop
        table = BlockTable(self._values, room_for=int(await client.hlen(state.blocks_key)))
        cursor = 0
        while True:
            cursor, fields = await client.hscan(state.blocks_key, cursor, count=SCAN_COUNT)
            if fields:
                hashes = list(fields)
                vid = self._values.vid
                table.set_vids(block_keys(b"".join(hashes), len(hashes[0])),
                               np.fromiter((vid(v) for v in fields.values()), np.uint32, len(fields)))
            if int(cursor) == 0:
                break
        state.table, state.seq, state.synced = table, seq, True
        state.applied.set()
        self._notify(state, None)

    @staticmethod
    async def _make_room(state: _Namespace, fields: dict) -> None:
        """Grows the namespace's table for the blocks ``fields`` (one record) may add, off the event loop: a grow
        rehashes every block (~1 s at a million), and lookups go on reading the table meanwhile (this task is its
        only writer). A load that replaced the table in between keeps its own."""
        table = state.table
        if fields[b"t"] == b"c" or table is None:
            return
        hash_len = int(fields[b"hl"])
        more = sum(len(run) - 2 for name, run in fields.items() if name not in _RECORD_FIELDS) // hash_len
        if table.needs_room(more):
            grown = await asyncio.to_thread(table.grown, more)
            if state.table is table:
                state.table = grown

    def _notify(self, state: _Namespace, keys: np.ndarray | None) -> None:
        for queue in state.subscribers:
            queue.put_nowait(Change(keys))

    def _apply(self, stream: _Stream, fields: dict) -> None:
        """Replays one record (see apply.lua, sweep.lua, prelude.lua's log_slot)."""
        if not isinstance(stream, _Namespace):
            slot = int(_s(fields[b"s"]))
            record = fields[b"r"]
            if record:
                self._slots[slot] = SlotRecord.parse(record)
            else:
                self._slots.pop(slot, None)
            for queue in self._slot_subscribers:
                queue.put_nowait([slot])
            return
        self.lag_ms.append(self.now_ms() - int(fields[b"ms"]))
        table = stream.table
        if fields[b"t"] == b"c":
            numbers = [int(x) for x in _s(fields[b"c"]).split(",") if x]
            table.clear_slots(dict(zip(numbers[::2], numbers[1::2])))
            self._notify(stream, None)
            return
        slot, hash_len = int(fields[b"s"]), int(fields[b"hl"])
        changed = []
        for name, run in fields.items():
            if name in _RECORD_FIELDS:
                continue
            op, mask = chr(run[0]), run[1] - 48
            keys = block_keys(run[2:], hash_len)
            table.apply_run(op, slot, mask, keys)
            changed.append(keys)
        if stream.subscribers and changed:
            self._notify(stream, np.concatenate(changed))
