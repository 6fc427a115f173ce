"""The integrity checksum of a block: CRC-32C (Castagnoli), and checking many blocks at once.

Computed once, when a block is committed (or taken from the source when it is
pulled or promoted), kept with the block and sent with every Lookup answer, so
a puller checks what it received without asking the source to read the block
again. ``crc32c`` uses the CPU's CRC instruction (SSE4.2, ARMv8) and releases
the GIL on large buffers.

Checking a pull's (or an Acquire's) blocks costs no Python per block: CRC is
linear, so the CRC of a run of blocks in consecutive slots is a fold of the
blocks' CRCs (``crc(A||B) = Z(crc(A)) ^ crc(B)``, ``Z`` the linear map "append
``len(B)`` zero bytes", as zlib's ``crc32_combine``). :class:`RunChecker`
computes the expected CRC of every run from the blocks' recorded CRCs with
numpy (the powers of ``Z`` for one block size are computed once), and the
actual CRC of the run's bytes in one ``crc32c`` call per run (in worker
threads, the GIL released). Only a run that does not match is checked block by
block, to find its first changed block. A run's check is as strong as its
blocks' (a change passes only by matching a 32-bit CRC). A pull's blocks are
checked piece by piece as its WRITE lands (:class:`LandingChecks`).
"""

from __future__ import annotations

import asyncio
import ctypes
import os

import numpy as np
from crc32c import crc32c

_POLY = 0x82F63B78  # CRC-32C, reflected
_BITS = np.arange(32, dtype=np.uint32)
# A copy goes a chunk at a time, its CRC taken while the chunk is still in cache: 256 KiB for one or two check
# threads (64 KiB-1 MiB measured alike), 4 MiB for more, where each chunk's two native calls hand the GIL over
# (128 MiB copied and checked on a 16-core host: 16.1 ms over 4 threads in 256 KiB chunks, 7.9 ms in 4 MiB ones).
_COPY_CHUNK = 256 * 1024
_COPY_CHUNK_MANY_THREADS = 4 * 1024 * 1024
# More threads copied faster there (5.5 ms over 8) but made a pull of 64 KiB blocks, and the Acquire after it,
# slower (more GIL handovers per run): docs/data_plane.md, "Issue 22, item 3, on 16 cores".
MAX_AUTO_THREADS = 4


def checksum(data) -> int:
    """CRC-32C of a buffer (bytes, memoryview, a contiguous numpy array)."""
    return crc32c(data)


def _times(matrix: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """GF(2) matrix (32 uint32 columns; or one matrix per vector, shape (n, 32)) times 32-bit vectors."""
    bits = ((vectors[..., None] >> _BITS) & 1).astype(bool)
    return np.bitwise_xor.reduce(np.where(bits, matrix, np.uint32(0)), axis=-1).astype(np.uint32)


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The matrix ``a . b`` (columns)."""
    return _times(a, b)


def _zeros_operator(nbytes: int) -> np.ndarray:
    """The map from a CRC-32C register to the register after ``nbytes`` more zero bytes."""
    one_bit = np.array([_POLY] + [1 << n for n in range(31)], dtype=np.uint32)
    op = one_bit
    for _ in range(3):  # 1 -> 2 -> 4 -> 8 zero bits: one zero byte
        op = _product(op, op)
    out = np.array([1 << n for n in range(32)], dtype=np.uint32)  # identity
    while nbytes:
        if nbytes & 1:
            out = _product(op, out)
        op = _product(op, op)
        nbytes >>= 1
    return out


class CrcFolder:
    """Expected CRC-32C of runs of ``block_bytes``-byte blocks from the blocks' own CRCs, vectorised."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._step = _zeros_operator(block_bytes)
        self._powers = np.array([[1 << n for n in range(32)]], dtype=np.uint32)  # powers[j]: the step j times

    def _powers_upto(self, n: int) -> np.ndarray:
        """At least ``n`` powers of the step; grown in place by whichever thread needs more (any array assigned
        is a correct prefix, so threads racing here only repeat work)."""
        while len(self._powers) < n:  # doubling: powers[m:2m] = step^m . powers[0:m]
            m = len(self._powers)
            top = self._step if m == 1 else _product(self._step, self._powers[m - 1])
            self._powers = np.concatenate([self._powers, _times(top, self._powers)])
        return self._powers

    def fold(self, crcs: np.ndarray) -> int:
        """The CRC-32C of the blocks laid end to end, given each block's CRC-32C (in order)."""
        n = len(crcs)
        if n == 0:
            return 0
        powers = self._powers_upto(n)[n - 1::-1]  # block i is followed by n - 1 - i blocks
        return int(np.bitwise_xor.reduce(_times(powers, np.asarray(crcs, dtype=np.uint32))))


def slot_runs(slots: np.ndarray, other: np.ndarray | None = None) -> np.ndarray:
    """Start indexes of the runs of consecutive slots in ``slots`` (and, when given, in ``other`` at the same
    indexes), plus ``len(slots)`` at the end."""
    n = len(slots)
    if n <= 1:
        return np.array([0, n], dtype=np.intp)
    steps = np.diff(slots) != 1
    if other is not None:
        steps |= np.diff(other) != 1
    return np.concatenate([[0], np.flatnonzero(steps) + 1, [n]]).astype(np.intp)


def check_threads(configured: int) -> int:
    """The threads a pull's copy and check use: ``configured``, or for 0 one per CPU this process may run on, at
    most :data:`MAX_AUTO_THREADS`."""
    return configured or max(1, min(MAX_AUTO_THREADS, len(os.sched_getaffinity(0))))


def copy_and_checksum(dst: np.ndarray, src: np.ndarray, checksum: bool = True, chunk: int = _COPY_CHUNK) -> int:
    """Copies ``src`` into ``dst`` (flat uint8 arrays of one length) ``chunk`` bytes at a time, and returns the
    CRC-32C of what ``dst`` holds after each chunk's copy (0 when ``checksum`` is off): the check of the copy, never
    of a source that may change under it."""
    crc, to, frm, view = 0, dst.ctypes.data, src.ctypes.data, memoryview(dst)
    for at in range(0, len(src), chunk):
        n = min(chunk, len(src) - at)
        ctypes.memmove(to + at, frm + at, n)  # a foreign call: the GIL is released
        if checksum:
            crc = crc32c(view[at:at + n], crc)
    return crc


class RunChecker:
    """Checks blocks in a region of ``block_bytes`` slots (its ``array``: flat uint8, read at each check, so the
    region can be unmapped once no check runs) against their CRC-32Cs; given a ``source`` (the flat array of
    another region of ``block_bytes`` slots, and each block's slot there), copies them from it first and checks
    the copies."""

    def __init__(self, region, block_bytes: int, threads: int) -> None:
        self._region = region
        self._bb = block_bytes
        self._threads = max(1, threads)
        self._chunk = _COPY_CHUNK if self._threads <= 2 else _COPY_CHUNK_MANY_THREADS
        self._folder = CrcFolder(block_bytes)

    def _parts(self, slots: np.ndarray, threads: int, source_slots: np.ndarray | None) -> list[tuple[int, int]]:
        """(first index, end index) pieces of runs of consecutive slots (on both sides, with a source): every run,
        the longest ones cut so that the work splits over ``threads``."""
        edges = slot_runs(slots, source_slots)
        cap = max(1, -(-len(slots) // threads))
        parts = []
        for start, end in zip(edges[:-1].tolist(), edges[1:].tolist()):
            for i in range(start, end, cap):
                parts.append((i, min(i + cap, end)))
        return parts

    def _first_bad(self, slots: np.ndarray, expected: np.ndarray | None, parts: list[tuple[int, int]],
                   source: tuple[np.ndarray, np.ndarray] | None) -> int:
        """The index of the first block (of ``parts``) whose bytes do not match; ``len(slots)`` if none. Without
        ``expected``: only copies from the source."""
        bb, region = self._bb, self._region.array
        for start, end in parts:
            lo, size = int(slots[start]) * bb, (end - start) * bb
            if source is not None:
                at = int(source[1][start]) * bb
                actual = copy_and_checksum(region[lo:lo + size], source[0][at:at + size], expected is not None,
                                           self._chunk)
            else:
                actual = crc32c(region[lo:lo + size])
            if expected is None or actual == self._folder.fold(expected[start:end]):
                continue
            for i in range(start, end):  # a changed block: which one
                at = int(slots[i]) * bb
                if crc32c(region[at:at + bb]) != int(expected[i]):
                    return i
        return len(slots)

    async def first_mismatch(self, slots, expected, threads: int = 0,
                             source: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        """Index of the first block whose slot's bytes do not have its expected CRC-32C (``len(slots)`` when
        all match); runs of consecutive slots are checked in one native call each, over ``threads`` threads
        (0: the checker's own count). With ``source`` (an array, each block's slot in it), each block is first
        copied from there into its slot, and the copy is checked. ``expected`` None: copies, checks nothing."""
        slots = np.asarray(slots, dtype=np.int64)
        if expected is not None:
            expected = np.asarray(expected, dtype=np.uint32)
        if source is not None:
            source = (source[0], np.asarray(source[1], dtype=np.int64))
        if len(slots) == 0:
            return 0
        threads = threads or self._threads
        parts = self._parts(slots, threads, None if source is None else source[1])
        step = -(-len(parts) // threads)
        shares = [parts[i:i + step] for i in range(0, len(parts), step)]
        found = await asyncio.gather(*(asyncio.to_thread(self._first_bad, slots, expected, share, source)
                                       for share in shares))
        return min(found)


class LandingChecks:
    """The check of one pull's blocks (``slots``, ``expected`` CRC-32Cs, in order) while its WRITE lands: each
    piece the source reports landed (:meth:`landed`) is checked at once, in one thread (the copy keeps the
    other core), and :meth:`first_mismatch`, once the WRITE has ended, checks whatever no early check passed
    (a piece reported before its bytes were all there fails its early check and is simply checked again).
    Every block is checked after its bytes landed; a report only moves the check earlier."""

    def __init__(self, checker: RunChecker, slots: np.ndarray, expected,
                 source: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """``source``: where the blocks land (an arena's array and each block's slot in it), copied into
        ``slots`` as they are checked."""
        self._checker = checker
        self._slots = np.asarray(slots, dtype=np.int64)
        self._expected = np.asarray(expected, dtype=np.uint32)
        self._source = None if source is None else (source[0], np.asarray(source[1], dtype=np.int64))
        self._passed = np.zeros(len(self._slots), dtype=bool)
        self._running: set[asyncio.Task] = set()

    def landed(self, first: int, count: int) -> None:
        """Blocks ``first`` to ``first + count - 1`` have landed (says the source): checks them now. A range
        outside the pull's blocks is ignored."""
        if first < 0 or count <= 0 or first + count > len(self._slots):
            return
        task = asyncio.get_running_loop().create_task(self._check(first, first + count))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _check(self, start: int, end: int) -> None:
        if await self._checker.first_mismatch(self._slots[start:end], self._expected[start:end], threads=1,
                                              source=self._part(start, end)) == end - start:
            self._passed[start:end] = True

    async def first_mismatch(self, n: int) -> int:
        """Once the WRITE of the leading ``n`` blocks has ended: the index of the first of them whose bytes do
        not have its CRC-32C (``n`` when all match)."""
        if self._running:  # started: finishing them costs less than checking their blocks again
            await asyncio.gather(*self._running, return_exceptions=True)
        todo = np.flatnonzero(~self._passed[:n])
        if len(todo) == 0:
            return n
        bad = await self._checker.first_mismatch(self._slots[todo], self._expected[todo],
                                                 source=None if self._source is None else
                                                 (self._source[0], self._source[1][todo]))
        return int(todo[bad]) if bad < len(todo) else n

    def _part(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray] | None:
        return None if self._source is None else (self._source[0], self._source[1][start:end])
