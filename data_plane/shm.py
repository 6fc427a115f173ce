"""The shared-memory region that holds a node's CPU tier.

One file under ``/dev/shm`` (tmpfs) mapped ``MAP_SHARED``: the data-plane
process owns it (creates, locks, registers it with NIXL, removes it), and the
engine process on the same node maps the same file (:class:`SharedTier` in
:mod:`data_plane.client`) to read and write slots without a copy through gRPC.

The owner creates the file exclusively (:mod:`data_plane.files`: ``O_EXCL |
O_NOFOLLOW``, mode 0600, owner and mode checked) and takes an exclusive
``flock`` on it for its lifetime, so a second data plane with the same file
fails at start instead of clobbering it, while a file left behind by a crashed
process (this user's, unlocked) is replaced.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
from pathlib import Path

import numpy as np

from data_plane.files import create_exclusive, open_existing

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)


class RegionBusy(RuntimeError):
    """Another live process owns the region file."""


def _abandoned(path: Path) -> bool:
    """A region file no live data plane holds (its owner crashed); RegionBusy when one does."""
    fd = open_existing(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RegionBusy(f"{path} is owned by another running data plane") from None
    finally:
        os.close(fd)
    return True


class SharedRegion:
    """``num_slots`` slots of ``block_bytes`` each, contiguous, in one shm file.

    Threading: the mapping is shared memory; callers coordinate slot ownership
    (the tier's lifecycle does). ``close`` must be the last call.
    """

    def __init__(self, path: Path, block_bytes: int, num_slots: int, *, owner: bool, lock_memory: bool = False):
        self.path = Path(path)
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.size = block_bytes * num_slots
        self.owner = owner
        self.locked = False
        self._fd = create_exclusive(self.path, _abandoned) if owner else open_existing(self.path)
        try:
            if owner:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise RegionBusy(f"{self.path} is owned by another running data plane") from None
                os.ftruncate(self._fd, self.size)
            elif os.fstat(self._fd).st_size < self.size:
                raise ValueError(f"{self.path} is smaller than {num_slots} slots of {block_bytes} bytes")
            self._map = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as exc:
            os.close(self._fd)
            if owner and not isinstance(exc, RegionBusy):
                self.path.unlink(missing_ok=True)  # no tier file of the size refused is left behind
            if isinstance(exc, OSError) and exc.errno in (errno.ENOMEM, errno.EFBIG, errno.ENOSPC, errno.EINVAL):
                raise ValueError(f"cannot map a CPU tier of {self.size >> 20} MiB at {self.path} "
                                 f"({os.strerror(exc.errno)}): lower capacity_bytes (--capacity-bytes) to what the "
                                 f"host's memory and {self.path.parent} can hold") from None
            raise
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.base_addr = int(self.array.ctypes.data)
        if lock_memory:
            self.locked = self._mlock()

    def _mlock(self) -> bool:
        if _libc.mlock(ctypes.c_void_p(self.base_addr), ctypes.c_size_t(self.size)) == 0:
            return True
        err = ctypes.get_errno()
        hint = " (raise `ulimit -l` or grant CAP_IPC_LOCK)" if err in (errno.EPERM, errno.ENOMEM) else ""
        log.warning(
            "mlock of the %d MiB CPU tier failed: %s%s; continuing with pageable memory (pages are "
            "pre-faulted, but may be swapped out under memory pressure)",
            self.size >> 20, os.strerror(err), hint,
        )
        self.array[:: mmap.PAGESIZE] = 0  # fault every page in now rather than during a transfer
        return False

    def file_identity(self) -> tuple[int, int]:
        """(device, inode) of the file mapped: another file at the same path is another region."""
        st = os.fstat(self._fd)
        return st.st_dev, st.st_ino

    def offset(self, slot: int) -> int:
        return slot * self.block_bytes

    def slot(self, slot: int) -> np.ndarray:
        """A writable view of one slot (no copy)."""
        start = slot * self.block_bytes
        return self.array[start : start + self.block_bytes]

    def close(self) -> None:
        """Unmaps; the owner also removes the file. Views from :meth:`slot` must be gone."""
        if self.locked:
            _libc.munlock(ctypes.c_void_p(self.base_addr), ctypes.c_size_t(self.size))
        del self.array
        self._map.close()
        if self.owner:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
