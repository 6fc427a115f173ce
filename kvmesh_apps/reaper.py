"""Cleans up after a tethered fleet (``kvmesh up``) however it ends, SIGKILL included.

``python -m kvmesh_apps.reaper DIR``, started by :class:`kvmesh_apps.fleet.Fleet` with a pipe on its stdin,
in its own session and ignoring the terminal's signals. It reads one pid per line (the fleet's children,
each held by a pidfd at once, so a reused pid is never signalled). At end of file (the fleet closed the
pipe after stopping, or its process died and the kernel closed it) it waits up to :data:`GRACE_S` for those
processes to end (their :class:`kvmesh_apps.procs.Tether` sent them SIGTERM), SIGKILLs what is left and
removes DIR, the data planes' shared-memory directory. Whatever file descriptors the fleet passes it (the
work directory's lock) stay held until then.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 3.0


class Reaper:
    """The fleet's side: starts the reaper, hands it each child's pid, and ends it after a clean stop."""

    def __init__(self, directory: Path, hold_fds: tuple[int, ...] = ()) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.reaper", str(directory)],
                                      stdin=subprocess.PIPE, text=True, start_new_session=True, pass_fds=hold_fds)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def watch(self, pid: int) -> None:
        self._proc.stdin.write(f"{pid}\n")
        self._proc.stdin.flush()

    def finish(self, timeout: float = GRACE_S + 2) -> None:
        """Closes the pipe (the children are stopped: nothing to wait for) and waits for the reaper to end."""
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _wait(pidfd: int, seconds: float) -> bool:
    return bool(select.select([pidfd], [], [], max(0.0, seconds))[0])


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pidfds = []
    for line in sys.stdin:
        try:
            pidfds.append(os.pidfd_open(int(line)))
        except (ValueError, ProcessLookupError):  # gone already
            pass
    deadline = time.monotonic() + GRACE_S
    for pidfd in pidfds:
        if not _wait(pidfd, deadline - time.monotonic()):
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait(pidfd, 1.0)
    shutil.rmtree(argv[0], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
