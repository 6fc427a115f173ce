"""Creating the tier files safely: exclusively, never through a link, only this user's, mode 0600.

The CPU tier lives in a shared-memory file (usually under ``/dev/shm``, writable by every local user)
and the disk tier in a file of its own. Another local user must not be able to make a data plane
write KV bytes into a file they can read (a file or symlink planted at the expected name), nor read
the file afterwards. So a tier file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600,
in a directory that is either private or sticky (like ``/dev/shm`` and ``/tmp``: others cannot rename
or delete our files there). A file already at the name is reused only when it is a regular file this
user owns, with no group or other permissions, and the caller says it is stale (a crash left it);
anything else stops the service with the reason. A planted name can therefore deny service (refused
at start, with a message) but never capture bytes. A private ``shm_dir`` / ``disk_dir`` removes even
that: ``kvmesh up`` and the tests use one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeFile(PermissionError):
    """A tier file or its directory is not safe to use; the message says why."""


def check_directory(path: Path) -> None:
    """Refuses a directory others may write into unless it is sticky, or one owned by another user."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(f"{path} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise UnsafeFile(f"{path} belongs to uid {st.st_uid}, not this service (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeFile(f"{path} is writable by other users and not sticky: use a private directory (mode 0700)")


def _check_ours(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{path} exists and is not a regular file (a link or device?): refusing to use it")
    if st.st_uid != os.geteuid():
        raise UnsafeFile(f"{path} exists and belongs to uid {st.st_uid}: refusing to use it")
    if st.st_mode & 0o077:
        raise UnsafeFile(f"{path} exists with mode {stat.S_IMODE(st.st_mode):o}: others may read it; refusing")


def create_exclusive(path: Path, stale: Callable[[Path], bool]) -> int:
    """A new file at ``path`` (mode 0600), open read-write; returns its descriptor.

    When a file is already there it must be this user's private regular file and ``stale(path)`` must
    say it is abandoned: it is then removed and created afresh. Otherwise FileExistsError / UnsafeFile.
    """
    path = Path(path)
    check_directory(path.parent)
    try:
        fd = os.open(path, _CREATE, 0o600)
    except FileExistsError:
        _check_ours(path, os.lstat(path))
        if not stale(path):
            raise
        path.unlink()
        fd = os.open(path, _CREATE, 0o600)
    try:
        _check_ours(path, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_existing(path: Path) -> int:
    """Opens a tier file another process created (read-write), never through a link."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeFile(f"{path} is not a regular file")
    return fd
