"""The replica's table (control_plane/replica_table.py) on its own: a lookup of a few keys (probed one at a time
in Python) answers as the vectorised probe does, on a table crowded with keys that share home positions; and
block keys read from packed hashes, a list of hashes and 8-byte change-stream keys agree."""

from __future__ import annotations

import hashlib

import numpy as np

from control_plane.model import PackedHashes
from control_plane.replica_table import SCALAR_PROBE, BlockTable, Values, block_keys


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
