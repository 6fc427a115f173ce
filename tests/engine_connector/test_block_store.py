"""ShmBlockStore: the shared-memory stand-in for the data plane (no vLLM needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine_connector.block_store import BlockReadError, ShmBlockStore

NBYTES = 4096
SLOTS = 4


def _block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, NBYTES, dtype=np.uint8)


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ShmBlockStore]:
    s = ShmBlockStore(tmp_path, block_nbytes=NBYTES, num_slots=SLOTS)
    yield s
    s.close()


def test_writes_are_visible_to_another_handle_after_commit(store: ShmBlockStore, tmp_path: Path) -> None:
    other = ShmBlockStore(tmp_path, block_nbytes=NBYTES, num_slots=SLOTS)
    try:
        store.write(_hash(1), _block(1))
        assert other.lookup([_hash(1)]) == 0
        store.commit()
        assert other.lookup([_hash(1)]) == 1
        np.testing.assert_array_equal(other.read(_hash(1)), _block(1))
    finally:
        other.close()


def test_lookup_counts_leading_hits_only(store: ShmBlockStore) -> None:
    for i in (1, 2, 4):
        store.write(_hash(i), _block(i))
    store.commit()
    assert store.lookup([_hash(1), _hash(2), _hash(3), _hash(4)]) == 2
    assert store.lookup([_hash(3), _hash(1)]) == 0
    assert store.lookup([]) == 0


def test_full_store_reuses_oldest_slot(store: ShmBlockStore) -> None:
    for i in range(SLOTS + 1):
        store.write(_hash(i), _block(i))
        store.commit()
    assert store.lookup([_hash(0)]) == 0
    assert store.lookup([_hash(i) for i in range(1, SLOTS + 1)]) == SLOTS
    with pytest.raises(BlockReadError):
        store.read(_hash(0))
    np.testing.assert_array_equal(store.read(_hash(SLOTS)), _block(SLOTS))


def test_rewriting_a_stored_hash_keeps_the_first_copy(store: ShmBlockStore) -> None:
    store.write(_hash(1), _block(1))
    store.commit()
    store.write(_hash(1), _block(2))
    store.commit()
    np.testing.assert_array_equal(store.read(_hash(1)), _block(1))


def test_corrupt_block_fails_read_and_is_dropped(store: ShmBlockStore, tmp_path: Path) -> None:
    store.write(_hash(1), _block(1))
    store.commit()
    data_file = tmp_path / ShmBlockStore.DATA_FILE
    data_file.write_bytes(bytes(data_file.stat().st_size))
    with pytest.raises(BlockReadError, match="integrity"):
        store.read(_hash(1))
    assert store.lookup([_hash(1)]) == 0
    store.write(_hash(1), _block(1))
    store.commit()
    np.testing.assert_array_equal(store.read(_hash(1)), _block(1))


def test_truncated_data_file_fails_read(store: ShmBlockStore, tmp_path: Path) -> None:
    store.write(_hash(1), _block(1))
    store.commit()
    (tmp_path / ShmBlockStore.DATA_FILE).write_bytes(b"")
    with pytest.raises(BlockReadError):
        store.read(_hash(1))


def test_geometry_is_fixed_by_the_first_opener(store: ShmBlockStore, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="4096 bytes"):
        ShmBlockStore(tmp_path, block_nbytes=NBYTES * 2, num_slots=SLOTS)


def test_write_rejects_wrong_size(store: ShmBlockStore) -> None:
    with pytest.raises(ValueError):
        store.write(_hash(1), np.zeros(NBYTES - 1, dtype=np.uint8))
