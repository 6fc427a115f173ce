"""The replica's table (control_plane/replica_table.py) on its own: a lookup of a few keys (probed one at a time
in Python) answers as the vectorised probe does, on a table crowded with keys that share both their buckets (the
overflow "stash" in use); the table answers as a dict through a random workload of stores, removals and resizes;
and block keys read from packed hashes, a list of hashes and 8-byte change-stream keys agree."""

from __future__ import annotations

import hashlib

import numpy as np

from control_plane.model import PackedHashes
from control_plane.replica_table import BUCKET, SCALAR_PROBE, BlockTable, Values, block_keys, encode_value


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


def test_a_few_keys_are_probed_as_the_vectorised_lookup_probes_them():
    table, stored, absent = _crowded_table()
    keys = np.concatenate([stored, absent])
    np.random.default_rng(7).shuffle(keys)
    whole = table.vids(keys)  # more than SCALAR_PROBE keys: the vectorised probe
    assert len(keys) > SCALAR_PROBE
    assert int(np.count_nonzero(whole)) == len(stored)  # every stored key found, no absent one
    for start in range(0, len(keys), SCALAR_PROBE):
        part = keys[start:start + SCALAR_PROBE]
        assert list(table.vids(part)) == list(whole[start:start + SCALAR_PROBE])
    stashed = int(np.count_nonzero(table.find(stored) >= table.capacity))
    assert stashed == len(stored) - 2 * BUCKET  # two full buckets, the rest in the stash: the stash was probed
    table.set_vids(stored[:10], np.zeros(10, np.uint32))  # removed, in the buckets and in the stash alike
    assert int(np.count_nonzero(table.vids(keys))) == len(stored) - 10 == len(table)


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


def _check_against_model(table: BlockTable, model: dict[int, int], probes: np.ndarray, whole: bool = True) -> None:
    """Every probe key's vid (vectorised, and in pieces the scalar probe answers) is the model's; the count too,
    and (``whole``) every present block."""
    want = np.array([model.get(int(k), 0) for k in probes], np.uint32)
    assert list(table.vids(probes)) == list(want)
    for start in range(0, len(probes), SCALAR_PROBE):
        assert list(table.vids(probes[start:start + SCALAR_PROBE])) == list(want[start:start + SCALAR_PROBE])
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
