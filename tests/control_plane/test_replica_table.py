"""The replica's table (control_plane/replica_table.py) on its own, with its native probe (control_plane/_probe.c):
keys found in both their buckets and in the overflow "stash" of a table crowded with keys that share both buckets;
the table answers as a dict through a random workload of stores, removals and resizes, key by key and as a
lookup's leading runs read straight from hashes; the probe refuses arrays that do not match the table; and block
keys read from packed hashes, a list of hashes and 8-byte change-stream keys agree."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvmesh.redis_keys import encode_value

from control_plane import _probe
from control_plane.model import PackedHashes
from control_plane.replica_table import BUCKET, BlockTable, Values, block_keys


def _crowded_table() -> tuple[BlockTable, np.ndarray, np.ndarray]:
    """A table where 120 stored keys share the same two buckets (their low 20 bits, and those of their high
    halves, are alike: the same two buckets at any capacity up to 2^23 slots), so most of them overflow into
    the stash; and keys never stored that land on those buckets too."""
    table = BlockTable(Values())
    alike = np.uint64(0x5_0000_0003)  # low half ends in 0x00003, high half in 0x00005
    spread = np.uint64(1 << 20)
    stored = alike + spread * np.arange(1, 121, dtype=np.uint64)
    table.apply_run("s", 3, 2, stored)
    absent = alike + spread * np.arange(200, 300, dtype=np.uint64)
    return table, stored, absent


def test_the_probe_finds_keys_in_both_buckets_and_in_the_stash():
    table, stored, absent = _crowded_table()
    keys = np.concatenate([stored, absent])
    np.random.default_rng(7).shuffle(keys)
    vid = table._values.vid(encode_value([(3, 2)]))  # slot 3, tier bit 2: what every stored key holds
    assert list(table.vids(keys)) == [vid if k in set(stored.tolist()) else 0 for k in keys.tolist()]
    stashed = int(np.count_nonzero(table.find(stored) >= table.capacity))
    assert stashed == len(stored) - 2 * BUCKET  # two full buckets, the rest in the stash: the stash was probed
    assert _leading_runs(table, stored) == [(vid, len(stored))]  # a lookup's runs, from the buckets and the stash
    table.set_vids(stored[:10], np.zeros(10, np.uint32))  # removed, in the buckets and in the stash alike
    assert int(np.count_nonzero(table.vids(keys))) == len(stored) - 10 == len(table)
    assert _leading_runs(table, stored) == []  # the first block removed: no prefix


def test_the_probe_refuses_arrays_that_do_not_match_the_table():
    """A native probe reads the arrays it is given: one whose size does not match the bucket mask is refused
    (ValueError), never read past its end."""
    table, stored, _ = _crowded_table()
    keys, vids, mask, stash_keys, stash_vids = table._probe_args()
    out = np.zeros(len(stored), np.uint32)
    _probe.vids(keys, vids, mask, stash_keys, stash_vids, stored, out)  # the positive control: as given, it reads
    assert int(np.count_nonzero(out)) == len(stored)
    for bad in ((keys[:-1], vids, mask, stash_keys, stash_vids), (keys, vids, mask * 2 + 1, stash_keys, stash_vids),
                (keys, vids, mask, stash_keys, stash_vids[:-1]), (keys, vids, mask - 1, stash_keys, stash_vids)):
        with pytest.raises(ValueError):
            _probe.vids(*bad, stored, out)
        with pytest.raises(ValueError):
            _probe.leading_runs(*bad, stored.astype("<u8").tobytes(), 8)
    with pytest.raises(ValueError):
        _probe.vids(keys, vids, mask, stash_keys, stash_vids, stored, out[:-1])  # too few vids for the keys
    with pytest.raises(ValueError):
        _probe.leading_runs(keys, vids, mask, stash_keys, stash_vids, b"x" * 20, 8)  # not whole hashes


def _leading_runs(table: BlockTable, keys: np.ndarray, hash_len: int = 8) -> list[tuple[int, int]]:
    """The probe's leading runs for ``keys`` given as hashes of ``hash_len`` bytes (each key's 8 bytes, then
    filler that must not count)."""
    hashes = b"".join(k.to_bytes(8, "little") + b"\xff" * (hash_len - 8) for k in keys.tolist())
    return _probe.leading_runs(*table._probe_args(), hashes, hash_len)


def _model_runs(model: dict[int, int], keys: np.ndarray) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for key in keys.tolist():
        vid = model.get(key, 0)
        if not vid:
            break
        if runs and runs[-1][0] == vid:
            runs[-1] = (vid, runs[-1][1] + 1)
        else:
            runs.append((vid, 1))
    return runs


def test_block_keys_of_packed_listed_and_8_byte_hashes_agree():
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(40)] + [bytes(32)]  # one all-zero hash
    listed = block_keys(hashes)
    packed = block_keys(PackedHashes(b"".join(hashes), 32))
    short = block_keys(b"".join(h[:8] for h in hashes), 8)
    odd = block_keys([h[:12] for h in hashes])  # a hash length not a multiple of 8
    for keys in (packed, short, odd):
        assert keys.dtype == listed.dtype and list(keys) == list(listed)
    assert listed[-1] == 1  # 0 marks an empty table slot: an all-zero key becomes 1
    assert listed[0] == int.from_bytes(hashes[0][:8], "little")
    packed[0] = 5  # a copy of its own, not a view of the message's bytes
    assert block_keys(PackedHashes(b"".join(hashes), 32))[0] != 5
    table = BlockTable(Values())  # a lookup reads its keys from the hashes as block_keys does (the all-zero one too)
    table.apply_run("s", 1, 1, listed)
    assert _probe.leading_runs(*table._probe_args(), b"".join(hashes[::-1]), 32) == [(1, len(hashes))]


def _check_against_model(table: BlockTable, model: dict[int, int], probes: np.ndarray, whole: bool = True) -> None:
    """Every probe key's vid is the model's, and so are a lookup's leading runs along the probes (8- and 32-byte
    hashes; present keys first, so that the runs are long); the count too, and (``whole``) every present block."""
    want = np.array([model.get(int(k), 0) for k in probes], np.uint32)
    assert list(table.vids(probes)) == list(want)
    along = np.concatenate([probes[want != 0], probes[want == 0]])
    assert _leading_runs(table, along) == _leading_runs(table, along, 32) == _model_runs(model, along)
    assert len(_model_runs(model, along)) > 1 or not along.size  # several values: runs end and begin
    assert len(table) == sum(1 for v in model.values() if v)
    if not whole:
        return
    keys, vids = table.items()
    assert dict(zip(keys.tolist(), vids.tolist())) == {k: v for k, v in model.items() if v}


def test_the_table_answers_as_a_dict_through_stores_removals_readds_and_resizes():
    """A random workload on one table, checked after every step against a plain dict: stores of new and known
    keys, removals (the key stays as a removed slot until the table is rebuilt), re-stores of removed keys, a
    key given twice in one call, sweeps of a slot, and growth from the smallest table through several resizes.
    A few keys a step share their first bucket with others, two share both buckets with every step's two (the
    stash), and probes include keys never stored, some on those buckets. Red when a probe misses a stored key,
    finds a removed one, or answers a key it never held."""
    rng = np.random.default_rng(22)
    values = Values()
    table = BlockTable(values, capacity=16)
    model: dict[int, int] = {}
    vid_of = [values.vid(encode_value([(s, 2)])) for s in range(1, 6)]
    crowd = np.arange(0xA00, 0xA10, dtype=np.uint64)  # 16 first buckets (below any capacity's mask)
    alike, spread = np.uint64(0x5_0000_0003), np.uint64(1 << 20)  # as in _crowded_table
    seen = np.zeros(0, np.uint64)
    grew = set()
    for step in range(300):
        fresh = rng.integers(1, 2**63, int(rng.integers(8, 200)), dtype=np.uint64)
        fresh[:3] = (fresh[:3] & ~np.uint64(0xFFF)) | rng.choice(crowd, 3)
        fresh[3:5] = alike + spread * rng.integers(1, 1 << 9, 2, dtype=np.uint64)  # both buckets shared: the stash
        known = seen[rng.integers(0, len(seen), int(rng.integers(0, 100)))] if len(seen) else seen
        keys = np.concatenate([fresh, known, fresh[-3:]])  # fresh[-3:] twice: the last vid wins
        vids = np.array(rng.choice([0, *vid_of], len(keys), p=[0.3, 0.14, 0.14, 0.14, 0.14, 0.14]), np.uint32)
        table.set_vids(keys, vids)
        for k, v in zip(keys.tolist(), vids.tolist()):
            model[k] = v
        if step % 50 == 49:  # sweep slot 2's tier bit 2 everywhere: its blocks held by no one else go
            table.clear_slots({2: 2})
            model = {k: (values.cleared(v, {2: 2}) if v else 0) for k, v in model.items()}
        seen = np.concatenate([seen, fresh])
        grew.add(table.capacity)
        never = rng.integers(1, 2**63, 64, dtype=np.uint64)
        never[:16] = (never[:16] & ~np.uint64(0xFFF)) | crowd  # absent keys on the crowded buckets
        never[16:20] = alike + spread * rng.integers(1 << 9, 1 << 10, 4, dtype=np.uint64)
        probes = np.concatenate([seen[rng.integers(0, len(seen), 300)], never])
        _check_against_model(table, model, probes, whole=step % 25 == 0)
    assert len(grew) >= 5  # the table was rebuilt several times along the way
    assert int(np.count_nonzero(table.find(np.array(list(model), np.uint64)) >= table.capacity)) > 100
    _check_against_model(table, model, np.array(list(model), np.uint64))


def test_a_grown_copy_answers_as_the_table_and_leaves_it_untouched():
    """The replica grows a table off the event loop by building a bigger copy while lookups read the table:
    the copy answers every key as the table does (stash included, removed keys gone), has room for what was
    asked without growing again, and the table's arrays are not written meanwhile. A load sized for what is
    coming does not grow at all. Red if the copy wrote into the table's arrays or lost a key."""
    table, stored, absent = _crowded_table()
    values = table._values
    more = np.arange(1, 400, dtype=np.uint64) * np.uint64(0x9E37_79B9_7F4A_7C15)
    table.set_vids(more, np.full(len(more), values.vid(encode_value([(4, 1)])), np.uint32))
    table.set_vids(more[:50], np.zeros(50, np.uint32))  # removed: slots used, blocks gone
    before = [a.copy() for a in table._probe_args()[:2]] + [table._stash_keys.copy(), table._stash_vids.copy()]
    need = table.capacity  # as many new keys as the table has slots: it must grow
    assert table.needs_room(need)
    copy = table.grown(need)
    probes = np.concatenate([stored, absent, more])
    assert np.array_equal(copy.vids(probes), table.vids(probes))
    assert len(copy) == len(table) == len(stored) + len(more) - 50
    assert not copy.needs_room(need) and copy.capacity > table.capacity
    after = [table._keys, table._vids, table._stash_keys, table._stash_vids]
    assert all(np.array_equal(b, a) for b, a in zip(before, after)), "growing the copy wrote into the table"
    sized = BlockTable(Values(), room_for=100_000)
    capacity = sized.capacity
    sized.set_vids(np.arange(1, 100_001, dtype=np.uint64) * np.uint64(0x9E37_79B9_7F4A_7C15),
                   np.ones(100_000, np.uint32))
    assert sized.capacity == capacity and len(sized) == 100_000  # no resize on the way
