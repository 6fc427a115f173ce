"""The in-memory form of one namespace's block map, and of the live-slot table (control_plane.replica).

A block is keyed by the first 8 bytes of its hash (a uint64; block hashes are cryptographic, so two blocks of a
10M-block map share a key with probability ~3e-6, and a false match costs at most a MISS at the source). The
table is open addressing over two numpy arrays, ``keys`` (uint64, 0 = empty) and ``vids`` (uint32, 0 = absent):
12 bytes a slot at a load of 1/4 to 1/2, so 24-48 bytes a block. A vid names an interned *value*, the block's
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

from control_plane.model import Medium, NodePrefix, PackedHashes, PrefixMatch

_EMPTY = np.uint64(0)
_GPU, _CPU, _DISK = Medium.GPU, Medium.CPU, Medium.DISK  # (an enum member read through its class costs a lookup)
PROBE_WINDOW = 8  # positions after a key's home one that BlockTable.vids probes in one gather
_WINDOW = np.arange(1, PROBE_WINDOW + 1)
SCALAR_PROBE = 16  # BlockTable.vids probes up to this many keys one at a time in Python
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
        keys = np.frombuffer(blob, "<u8")[::hash_len // 8]
    else:
        keys = np.frombuffer(blob, np.uint8).reshape(-1, hash_len)[:, :8].copy().view("<u8").reshape(-1)
    return np.maximum(keys, 1)  # a contiguous copy, with 0 made 1


def decode_value(value: bytes) -> tuple[tuple[int, int], ...]:
    """((slot, tier bits), ...) of a block-map value."""
    return tuple(((value[j] << 8 | value[j + 1]) >> 3, value[j + 1] & 7) for j in range(0, len(value), 2))


def encode_value(entries) -> bytes:
    return bytes(b for s, m in entries for b in divmod(s * 8 + m, 256))


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
    """One namespace's blocks: key -> vid, open addressing with linear probing (see the module docstring)."""

    def __init__(self, values: Values, capacity: int = 1024) -> None:
        self._values = values
        self._keys = np.zeros(capacity, np.uint64)
        self._vids = np.zeros(capacity, np.uint32)
        self._used = 0  # slots with a key (present blocks and removed ones)
        self._count = 0  # present blocks

    def __len__(self) -> int:
        return self._count

    def nbytes(self) -> int:
        return self._keys.nbytes + self._vids.nbytes

    # -- reads -------------------------------------------------------------------

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Table positions of ``keys`` (-1: never stored)."""
        mask = len(self._keys) - 1
        out = np.full(len(keys), -1, np.intp)
        todo = np.arange(len(keys))
        pos = (keys & np.uint64(mask)).astype(np.intp)
        want = keys
        while todo.size:
            found = self._keys[pos]
            hit = found == want
            out[todo[hit]] = pos[hit]
            more = ~(hit | (found == _EMPTY))
            todo, want, pos = todo[more], want[more], (pos[more] + 1) & mask
        return out

    def vids(self, keys: np.ndarray) -> np.ndarray:
        """The vid of each key (0: absent). Keys are never deleted (only their vid zeroed) until the table is
        rebuilt, so an empty slot ends a key's probe sequence. The keys not at their home position (a few at a
        load of at most 1/2) probe their next ``PROBE_WINDOW`` positions in one gather, and only the rare
        longer runs step on one position at a time: a handful of numpy calls whatever the probe lengths."""
        mask = len(self._keys) - 1
        if len(keys) <= SCALAR_PROBE:
            return self._vids_scalar(keys, mask)
        pos = keys.view(np.int64) & mask
        found = self._keys[pos]
        hit = found == keys
        out = self._vids[pos] * hit
        todo = np.flatnonzero(~hit & (found != _EMPTY))
        if not todo.size:
            return out
        window = (pos[todo, None] + _WINDOW) & mask
        slab = self._keys[window]
        want = keys[todo]
        hits = slab == want[:, None]
        stop = hits | (slab == _EMPTY)
        first = stop.argmax(axis=1)
        rows = np.arange(todo.size)
        found_at = hits[rows, first]
        out[todo[found_at]] = self._vids[window[rows, first][found_at]]
        more = ~stop[rows, first]
        todo, pos, want = todo[more], window[more, -1], want[more]
        while todo.size:
            pos = (pos + 1) & mask
            found = self._keys[pos]
            hit = found == want
            out[todo[hit]] = self._vids[pos[hit]]
            more = ~hit & (found != _EMPTY)
            todo, pos, want = todo[more], pos[more], want[more]
        return out

    def _vids_scalar(self, keys: np.ndarray, mask: int) -> np.ndarray:
        """:meth:`vids` one key at a time in Python: for a few keys, cheaper than a dozen numpy calls."""
        table, vids = self._keys, self._vids
        out = np.zeros(len(keys), np.uint32)
        for i, key in enumerate(keys.tolist()):
            pos = key & mask
            while (found := int(table[pos])) != key:
                if found == 0:
                    break
                pos = (pos + 1) & mask
            else:
                out[i] = vids[pos]
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, vids) of every present block."""
        present = self._vids != 0
        return self._keys[present], self._vids[present]

    def distinct_vids(self) -> np.ndarray:
        return np.unique(self._vids[self._vids != 0])

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
        before = self._vids[pos] != 0
        self._vids[pos] = vids
        # a position given twice (a key twice) counts once, with its last vid
        _, first = np.unique(pos[::-1], return_index=True)
        self._count += int(np.count_nonzero(vids[::-1][first])) - int(np.count_nonzero(before[::-1][first]))

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
        present = self._vids != 0
        new = mapping[self._vids[present]]
        self._count -= int(np.count_nonzero(new == 0))
        self._vids[present] = new

    def _insert(self, keys: np.ndarray) -> None:
        """Inserts distinct keys none of which is in the table (with vid 0)."""
        if (self._used + len(keys)) * 2 > len(self._keys):
            self._grow(self._used + len(keys))
        mask = len(self._keys) - 1
        pos = (keys & np.uint64(mask)).astype(np.intp)
        while keys.size:
            free = self._keys[pos] == _EMPTY
            candidates = np.flatnonzero(free)
            _, first = np.unique(pos[candidates], return_index=True)
            won = candidates[first]
            self._keys[pos[won]] = keys[won]
            lost = np.ones(keys.size, bool)
            lost[won] = False
            keys, pos = keys[lost], (pos[lost] + 1) & mask
            self._used += won.size

    def _grow(self, needed: int) -> None:
        keys, vids = self.items()
        capacity = len(self._keys)
        while capacity < 4 * max(needed - (self._used - len(keys)), len(keys), 256):
            capacity *= 2
        self._keys = np.zeros(capacity, np.uint64)
        self._vids = np.zeros(capacity, np.uint32)
        self._used = 0
        if keys.size:
            self._insert(keys)
            self._vids[self.find(keys)] = vids

    # -- the lookup ----------------------------------------------------------------

    def leading(self, keys: np.ndarray, tiers: int) -> dict[int, list[int]]:
        """lookup.lua's counts: slot -> [any, gpu, cpu, disk] leading blocks of ``keys`` on the tiers in mask
        ``tiers``, for the slots holding the first block."""
        vids = self.vids(keys)
        first = int(vids[0]) if len(vids) else 0
        if not first:
            return {}
        if (vids == first).all():  # one value all along (a prefix every holder holds in full): counts at once
            n = len(vids)
            return {s: [n, n * (m & 1), n * (m >> 1 & 1), n * (m >> 2 & 1)]
                    for s, m in ((s, m & tiers) for s, m in self._values.entries(first)) if m}
        absent = vids == 0
        end = int(absent.argmax()) if absent.any() else len(vids)
        vids = vids[:end]
        starts = [0, *(np.flatnonzero(vids[1:] != vids[:-1]) + 1).tolist()]  # runs of one value: few, usually 1
        runs = zip(vids[starts].tolist(), [b - a for a, b in zip(starts, [*starts[1:], end])])
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
