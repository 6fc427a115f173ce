"""Where the connector keeps KV blocks: the :class:`BlockStore` contract and a shared-memory store.

A block is addressed by its vLLM block hash (the chained prefix hash, so equal hashes mean
equal token prefixes for the same model) and holds ``block_nbytes`` bytes: that block's K
and V for every layer, in the engine's own layout (see ``engine_connector.kv_layout``).
A store serves one model and one KV layout; it does not namespace by model.

:class:`ShmBlockStore` is the stand-in until the data-plane client replaces it: a data file
of fixed-size slots in ``/dev/shm`` plus a SQLite index (hash -> slot, CRC32) next to it, so
any number of processes on the host can share it. Slots are reused in FIFO order when the
store is full; a reader racing an overwrite sees a CRC mismatch, never wrong data.
"""

from __future__ import annotations

import os
import sqlite3
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# SQLite's default limit on host parameters per statement is 32766; stay far below it.
_LOOKUP_CHUNK = 512


class BlockReadError(Exception):
    """A block could not be read intact (evicted, truncated or corrupt)."""


class BlockStore(ABC):
    """A content-addressed store of KV blocks keyed by vLLM block hash.

    Threading: an instance is used by one thread at a time (vLLM calls a connector
    serially); separate processes open their own instances on the same backing store.
    Writes are staged and become visible to :meth:`lookup` and :meth:`read` (in this
    and every other process) at :meth:`commit`.
    """

    @property
    @abstractmethod
    def block_nbytes(self) -> int:
        """Size of every block in bytes."""

    @abstractmethod
    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """Number of leading ``block_hashes`` present; stops at the first missing one.

        A hit is a promise that is not binding: the block may be evicted before it is
        read, in which case :meth:`read` raises.
        """

    @abstractmethod
    def read(self, block_hash: bytes) -> np.ndarray:
        """Return a fresh, writable ``uint8`` array of ``block_nbytes`` bytes.

        Raises :class:`BlockReadError` if the block is missing or fails its integrity
        check; a block that fails the check is dropped so a later write can replace it.
        """

    @abstractmethod
    def write(self, block_hash: bytes, data: np.ndarray) -> None:
        """Stage ``data`` (``block_nbytes`` bytes, copied) under ``block_hash``.

        Writing a hash that is already stored is a no-op at commit.
        """

    @abstractmethod
    def commit(self) -> None:
        """Publish all staged writes."""

    def close(self) -> None:
        """Release the store's resources; staged writes are discarded."""


class ShmBlockStore(BlockStore):
    """Fixed-size slots in a file under ``/dev/shm`` plus a SQLite index beside it.

    ``path`` is a directory holding ``blocks.data`` and ``index.sqlite``; the first
    opener fixes the geometry (``block_nbytes``, ``num_slots``) and later openers must
    pass the same values. Reads and writes use ``pread``/``pwrite``, so a truncated
    data file yields :class:`BlockReadError` rather than a bus error.
    """

    DATA_FILE = "blocks.data"
    INDEX_FILE = "index.sqlite"

    def __init__(self, path: str | os.PathLike[str], *, block_nbytes: int, num_slots: int) -> None:
        if block_nbytes <= 0 or num_slots <= 0:
            raise ValueError(f"block_nbytes and num_slots must be positive, got {block_nbytes}, {num_slots}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._block_nbytes = block_nbytes
        self._num_slots = num_slots
        self._staged: dict[bytes, np.ndarray] = {}
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
        # check_same_thread=False: vLLM may build a connector on one thread and call it
        # from another; it never calls it concurrently.
        self._db = sqlite3.connect(
            self.path / self.INDEX_FILE, isolation_level=None, timeout=30.0, check_same_thread=False
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=OFF")
        self._init_index()
        self._fd = os.open(self.path / self.DATA_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < block_nbytes * num_slots:
            os.ftruncate(self._fd, block_nbytes * num_slots)

    @property
    def block_nbytes(self) -> int:
        return self._block_nbytes

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        hits = 0
        for start in range(0, len(block_hashes), _LOOKUP_CHUNK):
            chunk = [bytes(h) for h in block_hashes[start : start + _LOOKUP_CHUNK]]
            marks = ",".join("?" * len(chunk))
            present = {row[0] for row in self._db.execute(f"SELECT hash FROM blocks WHERE hash IN ({marks})", chunk)}
            for block_hash in chunk:
                if block_hash not in present:
                    return hits
                hits += 1
        return hits

    def read(self, block_hash: bytes) -> np.ndarray:
        row = self._db.execute("SELECT slot, crc FROM blocks WHERE hash = ?", (bytes(block_hash),)).fetchone()
        if row is None:
            raise BlockReadError(f"block {bytes(block_hash).hex()[:16]} is not in the store")
        slot, crc = row
        out = np.empty(self._block_nbytes, dtype=np.uint8)
        got = os.preadv(self._fd, [memoryview(out)], slot * self._block_nbytes)
        if got != self._block_nbytes or zlib.crc32(out) != crc:
            self._drop(bytes(block_hash), slot)
            raise BlockReadError(
                f"block {bytes(block_hash).hex()[:16]} in slot {slot} failed its integrity check"
            )
        return out

    def write(self, block_hash: bytes, data: np.ndarray) -> None:
        if data.nbytes != self._block_nbytes:
            raise ValueError(f"block is {data.nbytes} bytes, store blocks are {self._block_nbytes}")
        self._staged[bytes(block_hash)] = np.array(data, dtype=np.uint8, copy=True).reshape(-1)

    def commit(self) -> None:
        if not self._staged:
            return
        staged, self._staged = self._staged, {}
        # The write lock is held while slots are chosen and filled, so two writers never
        # fill the same slot at once; readers never block and detect overwrites by CRC.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            next_seq = self._meta("next_seq")
            for block_hash, data in staged.items():
                if self._db.execute("SELECT 1 FROM blocks WHERE hash = ?", (block_hash,)).fetchone():
                    continue
                slot = next_seq % self._num_slots
                next_seq += 1
                self._db.execute("DELETE FROM blocks WHERE slot = ?", (slot,))
                os.pwritev(self._fd, [memoryview(data)], slot * self._block_nbytes)
                self._db.execute(
                    "INSERT INTO blocks (hash, slot, crc) VALUES (?, ?, ?)", (block_hash, slot, zlib.crc32(data))
                )
            self._db.execute("UPDATE meta SET value = ? WHERE key = 'next_seq'", (next_seq,))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._staged.clear()
        self._db.close()
        os.close(self._fd)

    def _init_index(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS blocks ("
                " hash BLOB PRIMARY KEY, slot INTEGER NOT NULL UNIQUE, crc INTEGER NOT NULL)"
            )
            for key, value in (("block_nbytes", self._block_nbytes), ("num_slots", self._num_slots), ("next_seq", 0)):
                self._db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, value))
            geometry = (self._meta("block_nbytes"), self._meta("num_slots"))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        if geometry != (self._block_nbytes, self._num_slots):
            raise ValueError(
                f"store at {self.path} holds blocks of {geometry[0]} bytes in {geometry[1]} slots; "
                f"asked for {self._block_nbytes} bytes in {self._num_slots} slots"
            )

    def _meta(self, key: str) -> int:
        return int(self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0])

    def _drop(self, block_hash: bytes, slot: int) -> None:
        # Only drop the entry we read: a writer may have re-filled the slot meanwhile.
        self._db.execute("DELETE FROM blocks WHERE hash = ? AND slot = ?", (block_hash, slot))
