"""The replica's table (control_plane/replica_table.py) on its own: a lookup of a few keys (probed one at a time
in Python) answers as the vectorised probe does, on a table crowded with keys that share home positions; and
block keys read from packed hashes, a list of hashes and 8-byte change-stream keys agree."""

from __future__ import annotations

import hashlib

import numpy as np

from control_plane.model import PackedHashes
from control_plane.replica_table import SCALAR_PROBE, BlockTable, Values, block_keys, encode_value


def _crowded_table() -> tuple[BlockTable, np.ndarray, np.ndarray]:
    """A table whose stored keys pile up on a few home positions (long probe runs), and keys never stored that
    land on those runs too."""
    table = BlockTable(Values())
    capacity = 1024
    stored = np.array([(i << 20) | (i % 7) for i in range(1, 300)], np.uint64)  # 7 home positions, 299 keys
    table.apply_run("s", 3, 2, stored)
    assert table.nbytes() == capacity * 12  # 12 bytes a slot: the crowding needs this capacity; fail if it moves
    absent = np.array([(i << 21) | (i % 7) | (1 << 40) for i in range(1, 100)], np.uint64)
    return table, stored, absent


def test_a_few_keys_are_probed_as_the_vectorised_lookup_probes_them():
    table, stored, absent = _crowded_table()
    keys = np.concatenate([stored, absent])
    np.random.default_rng(7).shuffle(keys)
    whole = table.vids(keys)  # more than SCALAR_PROBE keys: the vectorised probe
    assert len(keys) > SCALAR_PROBE
    assert int(np.count_nonzero(whole)) == len(stored)  # every stored key found, no absent one
    found_far = 0
    for start in range(0, len(keys), SCALAR_PROBE):
        part = keys[start:start + SCALAR_PROBE]
        assert list(table.vids(part)) == list(whole[start:start + SCALAR_PROBE])
        found_far += int(np.count_nonzero(table.find(part) != (part & np.uint64(1023)).astype(np.intp)))
    assert found_far > len(keys) // 2  # most keys sit (or end their probe) away from home: probing was exercised


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
    A few keys a step share their low 12 bits with others (runs of a few dozen positions), and probes include
    keys never stored, some on those runs. Red when a probe misses a stored key, finds a removed one, or answers a key it never held."""
    rng = np.random.default_rng(22)
    values = Values()
    table = BlockTable(values, capacity=16)
    model: dict[int, int] = {}
    vid_of = [values.vid(encode_value([(s, 2)])) for s in range(1, 6)]
    crowd = np.arange(0xA00, 0xA10, dtype=np.uint64)  # 16 home positions (below any capacity's mask)
    seen = np.zeros(0, np.uint64)
    grew = set()
    for step in range(300):
        fresh = rng.integers(1, 2**63, int(rng.integers(8, 200)), dtype=np.uint64)
        fresh[:3] = (fresh[:3] & ~np.uint64(0xFFF)) | rng.choice(crowd, 3)
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
        grew.add(table.nbytes())
        never = rng.integers(1, 2**63, 64, dtype=np.uint64)
        never[:16] = (never[:16] & ~np.uint64(0xFFF)) | crowd  # absent keys on the crowded runs
        probes = np.concatenate([seen[rng.integers(0, len(seen), 300)], never])
        _check_against_model(table, model, probes, whole=step % 25 == 0)
    assert len(grew) >= 5  # the table was rebuilt several times along the way
    _check_against_model(table, model, np.array(list(model), np.uint64))
