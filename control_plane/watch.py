"""WatchBlockMap: one namespace of this process's replica, streamed to a subscriber's replica.

The subscriber (a scheduler's :class:`control_plane.scheduler_client.SchedulerClient`) gets a snapshot of the
namespace, then what changes in it: block values, and the records of the live slots that hold its blocks. The
server decides what is sent: only the namespace asked for (the core authorised it), and only holders the
tenant's policy allows (``allows``); slots it may not know are never named, so their entries count for nothing
there, as fenced slots do. :class:`ReplicaView` is the subscriber's side: it applies these updates and answers
lookups as the server's replica would.

Threading model: one event loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable, Iterator

import numpy as np

from kvmesh.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unavailable
from kvmesh.v1 import control_plane_pb2 as pb

from control_plane.model import ALL_TIERS, PrefixMatch
from control_plane.replica import BlockMapReplica, Change
from control_plane.replica_table import BlockTable, SlotRecord, Values, packed, prefix_match

UNHELD_POLL_S = 1.0  # how often a watch of a namespace that holds no blocks checks whether it does now
SNAPSHOT_CHUNK = 100_000  # blocks per snapshot message (12 bytes each: well under gRPC's message limit)
# Changes queued for one subscriber while it does not read (gRPC flow control holds the stream): past this many, they
# are dropped and the subscriber is owed a fresh snapshot instead. Unbounded, a watch that was never read kept
# every change of its namespace in the control plane's memory for as long as its stream stayed open.
MAX_PENDING_CHANGES = 1024


@dataclass(frozen=True, slots=True)
class Holder:
    slot: int
    record: SlotRecord | None  # None: removed


@dataclass(frozen=True, slots=True)
class BlockMapUpdate:
    """One message of the watch (see BlockMapUpdate in control_plane.proto)."""

    reset: bool = False
    synced: bool = False
    holders: tuple[Holder, ...] = ()
    keys: bytes = b""  # little-endian uint64 block keys
    values: tuple[bytes, ...] = ()
    value_index: bytes = b""  # little-endian uint32 per key
    server_time_ms: int = 0

    def validate(self) -> "BlockMapUpdate":
        if len(self.keys) % 8 or len(self.value_index) != len(self.keys) // 2:
            raise InvalidArgument("keys and value_index do not match")
        index = np.frombuffer(self.value_index, "<u4")
        if index.size and int(index.max()) >= len(self.values):
            raise InvalidArgument("value_index points past values")
        if any(len(v) % 2 for v in self.values):
            raise InvalidArgument("a value is not whole 2-byte entries")
        return self


@dataclass
class _Named:
    """What one subscriber was told: the slot records sent, and every slot its values reference (a slot whose
    record arrives after the values naming it is sent then)."""

    records: dict[int, SlotRecord] = field(default_factory=dict)
    referenced: set[int] = field(default_factory=set)


class _Check:
    """Queue marker: time to check the subscriber's rights again."""


class _Pending(asyncio.Queue):
    """One subscriber's changes, at most MAX_PENDING_CHANGES of them: once it falls further behind, what is queued
    collapses into one "everything changed" (a snapshot follows, with every holder sent again)."""

    def put_nowait(self, item) -> None:
        if self.qsize() >= MAX_PENDING_CHANGES:
            while not self.empty():
                self.get_nowait()
            item = Change(None)
        super().put_nowait(item)


def _encoded(keys: np.ndarray, vids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A snapshot's distinct vids, its keys as little-endian uint64 and each key's index into the distinct vids as
    little-endian uint32: what its messages carry, cut into wire bytes by :func:`_chunks` as they are sent."""
    distinct, index = np.unique(vids, return_inverse=True)
    return distinct, keys.astype("<u8", copy=False), index.astype("<u4")


def _chunks(keys: np.ndarray, index: np.ndarray) -> Iterator[tuple[bytes, bytes]]:
    """The (keys, value indexes) wire bytes of each message of SNAPSHOT_CHUNK blocks, each made when asked for (one
    message, empty, for an empty namespace). Made all at once, a subscriber that did not read kept them all (12
    bytes a block, beside the arrays) in the control plane for as long as its stream stayed open."""
    for start in range(0, max(len(keys), 1), SNAPSHOT_CHUNK):
        yield keys[start:start + SNAPSHOT_CHUNK].tobytes(), index[start:start + SNAPSHOT_CHUNK].tobytes()


class BlockMapWatch:
    """Streams namespaces of ``replica`` (see the module docstring)."""

    def __init__(self, replica: BlockMapReplica, max_per_key: int, sync_timeout_s: float = 10.0) -> None:
        """``max_per_key``: watches one API key may have open at once (max_watches_per_key)."""
        self._replica = replica
        self._max_per_key = max_per_key
        self._sync_timeout_s = sync_timeout_s
        self._open: dict[str, int] = {}  # key id -> its watches open now

    async def updates(self, key_id: str, blocks_key: str, allows: Callable[[str], Awaitable[bool]],
                      still_allowed: Callable[[], Awaitable[bool]], recheck_s: float) -> AsyncIterator[BlockMapUpdate]:
        """The namespace at ``blocks_key`` for a subscriber holding API key ``key_id``: a snapshot, then its
        changes. ``allows(node_id)``: may the subscriber learn that node holds blocks; ``still_allowed()``, every
        ``recheck_s``: False ends the stream with PermissionDenied. ResourceExhausted when the key already has
        ``max_per_key`` watches open: each holds a snapshot's arrays while its subscriber does not read."""
        open_now = self._open.get(key_id, 0)
        if open_now >= self._max_per_key:
            raise ResourceExhausted(f"this key already has {open_now} WatchBlockMap streams open here "
                                    "(max_watches_per_key): close one, give each client its own key, or raise "
                                    "max_watches_per_key")
        self._open[key_id] = open_now + 1
        try:
            async with aclosing(self._updates(blocks_key, allows, still_allowed, recheck_s)) as updates:
                async for update in updates:
                    yield update
        finally:
            self._open[key_id] -= 1
            if not self._open[key_id]:
                del self._open[key_id]

    async def _updates(self, blocks_key: str, allows: Callable[[str], Awaitable[bool]],
                       still_allowed: Callable[[], Awaitable[bool]], recheck_s: float) -> AsyncIterator[BlockMapUpdate]:
        replica = self._replica
        if not await replica.holds_blocks(blocks_key):
            # not followed (nor counted against its tenant) until a batch claims it: a key that may read the
            # tenant watching made-up models took the tenant's every follow before, for the process's life
            yield BlockMapUpdate(reset=True, synced=True, server_time_ms=replica.now_ms())  # empty, complete
            while not await replica.holds_blocks(blocks_key):
                await asyncio.sleep(min(recheck_s, UNHELD_POLL_S))
                if not await still_allowed():
                    raise PermissionDenied("the right to read this namespace is gone (stream closed)")
        if not replica.follow(blocks_key):
            raise Unavailable("this control plane follows as many namespaces as it may; retry, or use LookupPrefix")
        queue = _Pending()
        replica.subscribe(blocks_key, queue)
        replica.slot_subscribe(queue)
        allowed: dict[str, bool] = {}

        async def may_name(record: SlotRecord) -> bool:
            if record.node_id not in allowed:
                allowed[record.node_id] = await allows(record.node_id)
            return allowed[record.node_id]

        named = _Named()
        try:
            async for update in self._snapshot(blocks_key, named, may_name):
                yield update
            next_check = time.monotonic() + recheck_s
            while True:
                try:
                    items = [await asyncio.wait_for(queue.get(), max(0.001, next_check - time.monotonic()))]
                except asyncio.TimeoutError:
                    items = [_Check]
                while not queue.empty():
                    items.append(queue.get_nowait())
                if time.monotonic() >= next_check:
                    if not await still_allowed():
                        raise PermissionDenied("the right to read this namespace is gone (stream closed)")
                    allowed.clear()
                    items.append(None)  # re-decide every holder sent under the policy of now
                    next_check = time.monotonic() + recheck_s
                if any(isinstance(i, Change) and i.keys is None for i in items) or not replica.in_sync(blocks_key):
                    named = _Named()
                    async for update in self._snapshot(blocks_key, named, may_name):
                        yield update
                    continue
                update = await self._changes(blocks_key, items, named, may_name)
                if update is not None:
                    yield update
        finally:
            replica.unsubscribe(blocks_key, queue)
            replica.slot_unsubscribe(queue)

    async def _snapshot(self, blocks_key, named: _Named, may_name) -> AsyncIterator[BlockMapUpdate]:
        replica = self._replica
        if not await replica.wait_synced(blocks_key, self._sync_timeout_s):
            raise Unavailable("the control plane's replica could not load this namespace in time; retry")
        # items(): copies, the follower may write the table meanwhile. The sort is linear or worse in the namespace
        # (0.1 s a million blocks): off the loop. Each message's bytes (a memory copy) are made as it is sent.
        distinct, keys, index = await asyncio.to_thread(_encoded, *replica.table(blocks_key).items())
        values = tuple(replica.values.value(int(v)) for v in distinct)
        holders = await self._new_holders(distinct, named, may_name)
        now = replica.now_ms()
        last = max(len(keys) - 1, 0) // SNAPSHOT_CHUNK
        for i, (key_bytes, index_bytes) in enumerate(_chunks(keys, index)):
            yield BlockMapUpdate(reset=i == 0, synced=i == last, holders=holders if i == 0 else (),
                                 keys=key_bytes, values=values, value_index=index_bytes, server_time_ms=now)

    async def _new_holders(self, vids, named: _Named, may_name) -> tuple[Holder, ...]:
        """Records of the slots in values ``vids`` not sent yet, if live and allowed."""
        replica = self._replica
        out = []
        for vid in vids.tolist():
            for slot, _ in replica.values.entries(vid):
                named.referenced.add(slot)
                record = replica.slots.get(slot)
                if slot not in named.records and record is not None and await may_name(record):
                    named.records[slot] = record
                    out.append(Holder(slot, record))
        return tuple(out)

    async def _changes(self, blocks_key, items, named: _Named, may_name) -> BlockMapUpdate | None:
        replica = self._replica
        holders = []
        slot_items = [i for i in items if i is None or isinstance(i, list)]
        changed_slots = set(named.referenced) if any(i is None for i in slot_items) else \
            {s for i in slot_items for s in i if s in named.referenced}
        for slot in changed_slots:
            record, previous = replica.slots.get(slot), named.records.get(slot)
            if record == previous:
                continue
            if record is not None and await may_name(record):
                named.records[slot] = record
                holders.append(Holder(slot, record))
            elif previous is not None:
                del named.records[slot]
                holders.append(Holder(slot, None))
        key_items = [i.keys for i in items if isinstance(i, Change) and i.keys is not None]
        keys = np.unique(np.concatenate(key_items)) if key_items else np.zeros(0, np.uint64)
        vids = replica.table(blocks_key).vids(keys)
        distinct, index = np.unique(vids, return_inverse=True)
        holders += await self._new_holders(distinct, named, may_name)
        if not holders and not keys.size:
            return None
        return BlockMapUpdate(holders=tuple(holders), keys=keys.astype("<u8").tobytes(),
                              values=tuple(replica.values.value(int(v)) for v in distinct),
                              value_index=index.astype("<u4").tobytes(), server_time_ms=replica.now_ms())


class ReplicaView:
    """The subscriber's replica of one namespace: applies :class:`BlockMapUpdate` messages, answers lookups."""

    def __init__(self) -> None:
        self._values = Values()
        self._table = BlockTable(self._values)
        self._slots: dict[int, SlotRecord] = {}
        self._clock_offset_ms = 0
        self.synced = False

    def apply(self, update: BlockMapUpdate) -> None:
        if update.reset:
            self._values = Values()
            self._table = BlockTable(self._values)
            self._slots = {}
            self.synced = False
        for holder in update.holders:
            if holder.record is None:
                self._slots.pop(holder.slot, None)
            else:
                self._slots[holder.slot] = holder.record
        if update.keys:
            mapping = np.array([self._values.vid(v) for v in update.values], np.uint32)
            self._table.set_vids(np.frombuffer(update.keys, "<u8").copy(),
                                 mapping[np.frombuffer(update.value_index, "<u4")])
        if update.server_time_ms:
            self._clock_offset_ms = update.server_time_ms - int(time.time() * 1000)
        self.synced = self.synced or update.synced

    def lookup(self, block_hashes: list[bytes], tiers: int = ALL_TIERS) -> PrefixMatch | None:
        """As the server's replica answers; None until the snapshot is complete."""
        if not self.synced:
            return None
        if not block_hashes:
            return PrefixMatch(0, [])
        counts = self._table.leading(*packed(block_hashes), tiers)
        return prefix_match(counts, self._slots, int(time.time() * 1000) + self._clock_offset_ms, len(block_hashes))

    def block_count(self) -> int:
        return len(self._table)

    def node_ids(self) -> set[str]:
        """The nodes this replica knows hold blocks (for tests and diagnostics)."""
        return {r.node_id for r in self._slots.values()}


# -- wire: BlockMapUpdate <-> control_plane.proto (the servicer's last step, the subscriber's first) --------

def block_map_update_to_pb(update: BlockMapUpdate) -> pb.BlockMapUpdate:
    reply = pb.BlockMapUpdate(reset=update.reset, synced=update.synced, keys=update.keys, values=update.values,
                              value_index=update.value_index, server_time_unix_ms=update.server_time_ms)
    for h in update.holders:
        if h.record is None:
            reply.holders.add(slot=h.slot, removed=True)
        else:
            reply.holders.add(slot=h.slot, node_id=h.record.node_id, data_plane_address=h.record.address,
                              lease_until_unix_ms=h.record.lease_until_ms)
    return reply


def block_map_update(msg: pb.BlockMapUpdate) -> BlockMapUpdate:
    holders = tuple(Holder(h.slot, None if h.removed else SlotRecord(h.node_id, 0, h.lease_until_unix_ms,
                                                                      h.data_plane_address))
                    for h in msg.holders)
    return BlockMapUpdate(msg.reset, msg.synced, holders, msg.keys, tuple(msg.values), msg.value_index,
                          msg.server_time_unix_ms).validate()
