"""The in-memory form of one namespace's block map, and of the live-slot table (control_plane.replica).

A block is keyed by the first 8 bytes of its hash (a uint64; block hashes are cryptographic, so two blocks of a
10M-block map share a key with probability ~3e-6, and a false match costs at most a MISS at the source). The
table is a two-choice bucketed hash over two numpy arrays, ``keys`` (uint64, 0 = empty) and ``vids`` (uint32,
0 = absent), in buckets of 4 slots: a key's two buckets are named by its low and its high 32 bits, and it sits in
the emptier one (or, both full, moves a key out of the way into that key's other bucket; failing that, into a
small sorted overflow, the "stash", which only crafted keys fill). Reads are one native call
(control_plane/_probe.c, a C extension pyproject.toml builds): a key is compared with its two buckets' 8 slots,
then searched in the stash; a lookup reads its keys straight from the request's hashes and gets back only the runs
of one value along the prefix (numpy took ~15 calls for the same probe, and a numpy call costs the server several
microseconds on cold caches whatever its size). Writes stay vectorised numpy (a few calls per run of blocks).
12 bytes a slot (and 1 a bucket) at a load of 1/4 to 1/2, so 24-48
bytes a block. A vid names an interned *value*, the block's
Redis value itself (2-byte entries ``slot * 8 + tier bits``, see docs/redis-schema.md): blocks along shared
prefixes share a handful of values, so a block held by 8 nodes costs its 12 bytes, not 16 more.

Updates replay what the Lua scripts did (apply.lua, sweep.lua) on whole runs of blocks at once; lookups
reproduce lookup.lua's answer (leading blocks per slot and per tier, live slots only).

Threading model: one event loop; nothing here awaits.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from kvmesh.redis_keys import decode_value, encode_value

from control_plane import _probe
from control_plane.model import Medium, NodePrefix, PackedHashes, PrefixMatch

_GPU, _CPU, _DISK = Medium.GPU, Medium.CPU, Medium.DISK  # (an enum member read through its class costs a lookup)
BUCKET = 4  # slots a bucket (4 keys: 32 bytes, half a cache line)
_BUCKET_SHIFT = 2  # log2(BUCKET): a compared slot's index >> this is its bucket's place among the gathered ones
_KEY_SHIFT = 3  # log2(2 * BUCKET): ... >> this is its key's index
INSERT_ROUNDS = 3  # rounds of placing a batch's keys before those left go to the stash
_KEY, _ONE = np.dtype("<u8"), np.uint64(1)
MEMO_LIMIT = 100_000  # remembered value transitions (a cache: cleared when full)


def block_keys(block_hashes: list[bytes] | PackedHashes | bytes, hash_len: int = 0) -> np.ndarray:
    """The uint64 keys of ``block_hashes`` (a list of equal-length hashes, a :class:`PackedHashes`, or hashes
    concatenated: give ``hash_len``); 0 becomes 1 (0 marks an empty slot of the table)."""
    if isinstance(block_hashes, PackedHashes):
        blob, hash_len = block_hashes.blob, block_hashes.size
    elif isinstance(block_hashes, (bytes, bytearray, memoryview)):
        blob = block_hashes
    else:
        blob = b"".join(block_hashes)
        hash_len = len(block_hashes[0]) if block_hashes else 8
    if hash_len % 8 == 0:  # every hash's first 8 bytes are a uint64 of the blob: a strided view, no reshaping
        keys = np.ndarray((len(blob) // hash_len,), _KEY, blob, 0, (hash_len,))
    else:
        keys = np.frombuffer(blob, np.uint8).reshape(-1, hash_len)[:, :8].copy().view(_KEY).reshape(-1)
    return np.maximum(keys, _ONE)  # a contiguous copy, with 0 made 1


def packed(block_hashes: list[bytes] | PackedHashes) -> tuple[bytes, int]:
    """(the hashes concatenated, the length of one) for :meth:`BlockTable.leading`."""
    if isinstance(block_hashes, PackedHashes):
        return block_hashes.blob, block_hashes.size
    return b"".join(block_hashes), len(block_hashes[0])


class Values:
    """Interned block-map values: vid -> value bytes; vid 0 is "absent". Shared by the tables of one replica."""

    def __init__(self) -> None:
        self._values: list[bytes] = [b""]
        self._decoded: list[tuple[tuple[int, int], ...]] = [()]
        self._vid: dict[bytes, int] = {b"": 0}
        self._changed: dict[tuple, int] = {}  # (vid, op, slot, mask) -> vid

    def vid(self, value: bytes) -> int:
        found = self._vid.get(value)
        if found is None:
            found = self._vid[value] = len(self._values)
            self._values.append(value)
            self._decoded.append(decode_value(value))
        return found

    def value(self, vid: int) -> bytes:
        return self._values[vid]

    def entries(self, vid: int) -> tuple[tuple[int, int], ...]:
        return self._decoded[vid]

    def __len__(self) -> int:
        return len(self._values)

    def changed(self, vid: int, op: str, slot: int, mask: int) -> int:
        """The vid after apply.lua's op ('s' sets, 'r' clears ``mask`` bits of ``slot``) on value ``vid``."""
        key = (vid, op, slot, mask)
        found = self._changed.get(key)
        if found is None:
            if len(self._changed) >= MEMO_LIMIT:
                self._changed.clear()
            out, seen = [], False
            for s, m in self._decoded[vid]:
                if s == slot:
                    seen = True
                    m = m | mask if op == "s" else m & (7 - mask)
                if m:
                    out.append((s, m))
            if op == "s" and not seen:
                out.append((slot, mask))
            found = self._changed[key] = self.vid(encode_value(out))
        return found

    def cleared(self, vid: int, clear: dict[int, int]) -> int:
        """The vid after sweep.lua's clear of ``clear`` (slot -> tier bits)."""
        return self.vid(encode_value([(s, m & (7 - clear.get(s, 0))) for s, m in self._decoded[vid]
                                      if m & (7 - clear.get(s, 0))]))

    def nbytes(self) -> int:
        return sum(sys.getsizeof(v) for v in self._values) + 64 * len(self._values)


class BlockTable:
    """One namespace's blocks: key -> vid in buckets of :data:`BUCKET` slots; a key sits in one of two buckets
    (see the module docstring), or, when both are full, in a small sorted overflow (the "stash")."""

    def __init__(self, values: Values, capacity: int = 1024, room_for: int = 0) -> None:
        """``room_for``: blocks it will hold without growing (a load that knows how many are coming)."""
        self._values = values
        while capacity < 2 * room_for:
            capacity *= 2
        self._allocate(capacity)
        self._used = 0  # slots with a key (present blocks and removed ones), stash included
        self._count = 0  # present blocks

    def _allocate(self, capacity: int) -> None:
        buckets = max(capacity // BUCKET, 2)
        self._keys = np.zeros((buckets, BUCKET), np.uint64)  # 0: an empty slot; a bucket fills from its front
        self._vids = np.zeros((buckets, BUCKET), np.uint32)
        self._fill = np.zeros(buckets, np.uint8)  # slots taken in each bucket
        self._mask = np.uint32(buckets - 1)
        self._stash_keys = np.zeros(0, np.uint64)  # sorted
        self._stash_vids = np.zeros(0, np.uint32)

    def __len__(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        """Slots in the buckets (the stash's are numbered from here on)."""
        return self._keys.size

    def nbytes(self) -> int:
        return (self._keys.nbytes + self._vids.nbytes + self._fill.nbytes + self._stash_keys.nbytes
                + self._stash_vids.nbytes)

    # -- reads -------------------------------------------------------------------

    def vids(self, keys: np.ndarray) -> np.ndarray:
        """The vid of each key (0: absent); ``keys`` a contiguous uint64 array (as :func:`block_keys` makes).
        One native call (control_plane/_probe.c) whatever the keys and the table hold."""
        out = np.zeros(len(keys), np.uint32)
        _probe.vids(*self._probe_args(), keys, out)
        return out

    def _probe_args(self) -> tuple:
        return self._keys, self._vids, int(self._mask), self._stash_keys, self._stash_vids

    def _in_stash(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.minimum(np.searchsorted(self._stash_keys, keys), len(self._stash_keys) - 1)
        return at, self._stash_keys[at] == keys

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Slot numbers of ``keys`` (bucket * BUCKET + slot; capacity + i for the stash's i-th key; -1: never
        stored)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        buckets = keys.view(np.uint32) & self._mask
        (hits,) = (self._keys.take(buckets, axis=0).reshape(-1) == np.repeat(keys, 2 * BUCKET)).nonzero()
        out = np.full(len(keys), -1, np.intp)
        out[hits >> _KEY_SHIFT] = buckets[hits >> _BUCKET_SHIFT].astype(np.intp) * BUCKET + (hits & (BUCKET - 1))
        if len(self._stash_keys):
            at, found = self._in_stash(keys)
            out[found] = self.capacity + at[found]
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, vids) of every present block."""
        present, stashed = self._vids != 0, self._stash_vids != 0
        return (np.concatenate([self._keys[present], self._stash_keys[stashed]]),
                np.concatenate([self._vids[present], self._stash_vids[stashed]]))

    def distinct_vids(self) -> np.ndarray:
        return np.unique(self.items()[1])

    # -- writes ------------------------------------------------------------------

    def set_vids(self, keys: np.ndarray, vids: np.ndarray) -> None:
        """Sets each key's vid (0 removes it); a key given twice takes its last vid."""
        pos = self.find(keys)
        while (missing := (pos < 0) & (vids != 0)).any():
            # a resize keeps present keys only: a removed key stored again in this call goes with it, and is
            # inserted on the next round (the resized table has room for all of them)
            self._insert(np.unique(keys[missing]))
            pos = self.find(keys)
        keep = pos >= 0
        pos, vids = pos[keep], vids[keep]
        before = self._read(pos) != 0
        self._write(pos, vids)
        # a position given twice (a key twice) counts once, with its last vid
        _, first = np.unique(pos[::-1], return_index=True)
        self._count += int(np.count_nonzero(vids[::-1][first])) - int(np.count_nonzero(before[::-1][first]))

    def _read(self, pos: np.ndarray) -> np.ndarray:
        size = self.capacity
        out = self._vids.reshape(-1)[np.minimum(pos, size - 1)]
        stashed = pos >= size
        if stashed.any():
            out[stashed] = self._stash_vids[pos[stashed] - size]
        return out

    def _write(self, pos: np.ndarray, vids: np.ndarray) -> None:
        """Sets the vids at slot numbers ``pos`` (as :meth:`find` gives them); the last of a repeated one wins."""
        size = self.capacity
        stashed = pos >= size
        if stashed.any():
            self._stash_vids[pos[stashed] - size] = vids[stashed]
            pos, vids = pos[~stashed], vids[~stashed]
        self._vids.reshape(-1)[pos] = vids

    def apply_run(self, op: str, slot: int, mask: int, keys: np.ndarray) -> None:
        """apply.lua on one run: set ('s') or clear ('r') ``mask`` bits of ``slot`` on the blocks ``keys``."""
        keys = np.unique(keys)
        old = self.vids(keys)
        distinct, inverse = np.unique(old, return_inverse=True)
        mapped = np.array([self._values.changed(int(v), op, slot, mask) if (v or op == "s") else 0
                           for v in distinct], np.uint32)
        self.set_vids(keys, mapped[inverse])

    def clear_slots(self, clear: dict[int, int]) -> None:
        """sweep.lua over the whole namespace: removes tier bits ``clear[slot]`` of those slots everywhere."""
        distinct = self.distinct_vids()
        if not distinct.size:
            return
        mapping = np.zeros(int(distinct.max()) + 1, np.uint32)
        for v in distinct:
            mapping[v] = self._values.cleared(int(v), clear)
        for vids in (self._vids, self._stash_vids):
            present = vids != 0
            new = mapping[vids[present]]
            self._count -= int(np.count_nonzero(new == 0))
            vids[present] = new

    def _insert(self, keys: np.ndarray) -> None:
        """Inserts distinct keys none of which is in the table (with vid 0): each into the emptier of its two
        buckets; keys bound for one bucket in the same round take its free slots in turn, and those left over
        try again (both buckets full after a few rounds: the stash)."""
        if (self._used + len(keys)) * 2 > self.capacity:
            self._grow(self._used + len(keys))
        for _ in range(INSERT_ROUNDS):
            pair = (keys.view(np.uint32) & self._mask).reshape(-1, 2).astype(np.intp)
            fill = self._fill[pair]
            bucket = np.where(fill[:, 1] < fill[:, 0], pair[:, 1], pair[:, 0])
            order = np.argsort(bucket, kind="stable")
            bucket, keys = bucket[order], keys[order]
            first = np.flatnonzero(np.concatenate([[True], bucket[1:] != bucket[:-1]]))
            rank = np.arange(len(bucket)) - np.repeat(first, np.diff(np.append(first, len(bucket))))
            slot = self._fill[bucket] + rank
            fits = slot < BUCKET
            self._keys[bucket[fits], slot[fits]] = keys[fits]
            np.add.at(self._fill, bucket[fits], 1)
            self._used += int(np.count_nonzero(fits))
            keys = keys[~fits]
            if not keys.size:
                return
        self._stash(np.array([k for k in keys.tolist() if not self._kick(k)], np.uint64))

    def _kick(self, key: int) -> bool:
        """Places ``key``, whose two buckets are full, by moving one of their keys to its other bucket if that
        one has room (False: none has)."""
        mask = int(self._mask)
        for bucket in (key & mask, key >> 32 & mask):
            for slot, resident in enumerate(self._keys[bucket].tolist()):
                other = resident >> 32 & mask if resident & mask == bucket else resident & mask
                if self._fill[other] < BUCKET:
                    free = int(self._fill[other])
                    self._keys[other, free], self._vids[other, free] = resident, self._vids[bucket, slot]
                    self._fill[other] += 1
                    self._keys[bucket, slot], self._vids[bucket, slot] = key, 0
                    self._used += 1
                    return True
        return False

    def _stash(self, keys: np.ndarray) -> None:
        if not keys.size:
            return
        stash_keys = np.concatenate([self._stash_keys, keys])
        order = np.argsort(stash_keys)
        self._stash_keys = stash_keys[order]
        self._stash_vids = np.concatenate([self._stash_vids, np.zeros(len(keys), np.uint32)])[order]
        self._used += len(keys)

    def needs_room(self, more: int) -> bool:
        """Would ``more`` new keys make the table grow (rehash every key it holds: ~1 s at a million blocks)?"""
        return (self._used + more) * 2 > self.capacity

    def grown(self, more: int) -> "BlockTable":
        """A copy with room for ``more`` new keys. This table is only read, so lookups may go on using it while
        the copy is built (the replica builds it off the event loop, then swaps it in)."""
        copy = BlockTable.__new__(BlockTable)
        copy._values, copy._count, copy._used = self._values, self._count, self._used
        copy._keys, copy._vids = self._keys, self._vids  # _grow reads them, then allocates its own
        copy._stash_keys, copy._stash_vids = self._stash_keys, self._stash_vids
        copy._grow(self._used + more)
        return copy

    def _grow(self, needed: int) -> None:
        keys, vids = self.items()
        capacity = self.capacity
        while capacity < 2 * max(needed - (self._used - len(keys)), len(keys), 256):  # a load of 1/4 to 1/2
            capacity *= 2
        self._allocate(capacity)
        self._used = 0
        if keys.size:
            self._insert(keys)
            self._write(self.find(keys), vids)

    # -- the lookup ----------------------------------------------------------------

    def leading(self, hashes: bytes, hash_len: int, tiers: int) -> dict[int, list[int]]:
        """lookup.lua's counts: slot -> [any, gpu, cpu, disk] leading blocks of ``hashes`` (concatenated, of
        ``hash_len`` bytes each) on the tiers in mask ``tiers``, for the slots holding the first block."""
        runs = _probe.leading_runs(*self._probe_args(), hashes, hash_len)  # [(vid, blocks), ...]: few, usually 1
        if not runs:
            return {}
        if len(runs) == 1:  # one value all along (a prefix every holder holds in full): counts at once
            first, n = runs[0]
            return {s: [n, n * (m & 1), n * (m >> 1 & 1), n * (m >> 2 & 1)]
                    for s, m in ((s, m & tiers) for s, m in self._values.entries(first)) if m}
        counts: dict[int, list[int]] = {}
        running: dict[int, list[bool]] = {}
        for vid, times in runs:
            present = {s: m & tiers for s, m in self._values.entries(vid) if m & tiers}
            if not counts:
                for s in present:
                    counts[s] = [0, 0, 0, 0]
                    running[s] = [True, True, True, True]
            extended = False
            for s, run in running.items():
                if not run[0]:
                    continue
                m = present.get(s)
                if not m:
                    run[0] = False
                    continue
                extended = True
                c = counts[s]
                c[0] += times
                for k in range(3):
                    if run[k + 1]:
                        if m >> k & 1:
                            c[k + 1] += times
                        else:
                            run[k + 1] = False
            if not extended:
                break
        return counts


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """A live slot's record in the live-slot table (prelude.lua's ``slot_record``)."""

    node_id: str
    incarnation: int
    lease_until_ms: int
    address: str

    @classmethod
    def parse(cls, record: bytes | str) -> "SlotRecord":
        text = record.decode() if isinstance(record, bytes) else record
        node_id, incarnation, lease_until, address = text.split("\t", 3)
        return cls(node_id, int(incarnation), int(lease_until), address)


def prefix_match(counts: dict[int, list[int]], slots: dict[int, SlotRecord], now_ms: int,
                 blocks_queried: int) -> PrefixMatch:
    """lookup.lua's answer as RedisBlockMap returns it: holders whose slot is live and lease unexpired."""
    holders = []
    for slot, (any_count, gpu, cpu, disk) in counts.items():
        record = slots.get(slot)
        if record is None or any_count <= 0 or record.lease_until_ms < now_ms:
            continue
        holders.append(NodePrefix(record.node_id, record.address, any_count, {_GPU: gpu, _CPU: cpu, _DISK: disk}))
    holders.sort(key=_longest_first)
    return PrefixMatch(blocks_queried, holders)


def _longest_first(holder: NodePrefix) -> tuple[int, str]:
    return -holder.leading_blocks, holder.node_id
