"""The work directory of ``kvmesh up``: where it is by default, the lock that keeps a second ``up`` out of it,
and the admin key kept in it.

By default the state lives in ``$XDG_STATE_HOME/kvmesh/up`` (``~/.local/state/kvmesh/up``), mode 0700, never in
a shared /tmp: Redis's data (AOF), the secrets, the grant-signing key and the logs, reused by the next start.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from kvmesh.errors import FailedPrecondition
from kvmesh_apps.redis_server import kept_secret
from tenancy.api_keys import new_key

LOCK_FILE = "up.lock"


def default_workdir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kvmesh" / "up"


class WorkdirLock:
    """An exclusive ``flock`` on ``<workdir>/up.lock``, holding the pid of the ``up`` that took it.

    It is held while any process that inherited :attr:`fd` lives (the fleet's children and its reaper are
    given it), so a new ``up`` cannot start while the last one's processes are still stopping."""

    def __init__(self, workdir: Path) -> None:
        if workdir.exists() and not workdir.is_dir():
            raise ValueError(f"--workdir {workdir} is a file, not a directory: name a directory (it is made if absent)")
        workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for place in (workdir, workdir / "secrets"):
            _own(place)
        path = workdir / LOCK_FILE
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise FailedPrecondition(f"{workdir} is in use by another kvmesh up (pid {holder}, or its services "
                                     "still stopping); stop that one, or give another --workdir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)


def _own(place: Path) -> None:
    """Refuses a work directory (or its secrets) another user owns or may write to: whoever can write there plants
    the fleet's admin key and the secrets it starts with."""
    try:
        st = os.lstat(place)
    except FileNotFoundError:
        return
    if not os.path.isdir(place) or os.path.islink(place) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise FailedPrecondition(
            f"{place} is not a directory of this user's that only it may write to (owner uid {st.st_uid}, mode "
            f"{st.st_mode & 0o777:o}): kvmesh up keeps the fleet's secrets there; give a --workdir of your own "
            "(the default is ~/.local/state/kvmesh/up), or `chmod go-w` it if it is yours")


def admin_key(workdir: Path, from_env: str | None) -> str:
    """The bootstrap admin key: the one this work directory was first started with (``secrets/admin.key``),
    else ``from_env`` ($KVMESH_ADMIN_KEY) or a new one. Tenant Redis passwords derive from it, so a different
    ``from_env`` on a restart is refused (:class:`FailedPrecondition`)."""
    path = workdir / "secrets" / "admin.key"
    key = kept_secret(path, lambda: from_env or new_key()[1])
    if from_env and from_env != key:
        raise FailedPrecondition(f"KVMESH_ADMIN_KEY differs from the admin key {workdir} was started with ({path}: "
                                 "tenant Redis passwords derive from it); unset it, or give another --workdir")
    return key
