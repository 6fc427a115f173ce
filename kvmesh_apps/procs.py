"""Starting kvmesh services as child processes (benchmarks, the demo, `kvmesh up`, tests).

A :class:`Tether` binds children to the process that starts them (``kvmesh up``): however that process ends,
SIGKILL included, they end too.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.errors import Unavailable

_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_METRICS = re.compile(r"metrics on (http://\S+/metrics)")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Tether:
    """What ties a child to its parent (``kvmesh up``).

    - Its own session and process group: a terminal's Ctrl-C or hang-up reaches the parent only, which stops
      the children in order.
    - SIGTERM when the parent dies, however it dies (``PR_SET_PDEATHSIG``, set between fork and exec; it is
      the thread that started the child whose death counts, so start children from the main thread).
    - ``hold_fds`` inherited: e.g. the work directory's lock stays held until the last child is gone.
    """

    hold_fds: tuple[int, ...] = ()

    def popen_kwargs(self) -> dict[str, Any]:
        return {"start_new_session": True, "preexec_fn": _die_with_parent(os.getpid()), "pass_fds": self.hold_fds}


def _die_with_parent(parent: int):
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: the child only calls it

    def set_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return set_signal


@dataclass
class ServiceProcess:
    """A ``kvmesh <command>`` child whose first 'listening on host:port' line gives its address."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    prefix: list[str] = field(default_factory=list)  # e.g. kvmesh_apps.netns.Network.prefix(host)
    tether: Tether | None = None
    on_spawn: Callable[[int], None] | None = None  # told the child's pid as soon as it exists
    proc: subprocess.Popen | None = None
    address: str = ""
    metrics_url: str = ""  # its 'metrics on URL' line, when it serves metrics

    def start(self, timeout: float = 60.0) -> "ServiceProcess":
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "kvmesh_apps.cli", *self.args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     **(self.tether.popen_kwargs() if self.tether else {}))
        if self.on_spawn is not None:
            self.on_spawn(self.proc.pid)
        found = threading.Event()
        lines: list[str] = []

        def pump() -> None:
            log = open(self.log_path, "a") if self.log_path else None
            for line in self.proc.stdout:
                if log:
                    log.write(line)
                    log.flush()
                if not found.is_set():
                    lines.append(line)
                    metrics = _METRICS.search(line)
                    if metrics:
                        self.metrics_url = metrics.group(1)
                    match = _LISTENING.search(line)
                    if match:
                        self.address = f"{match.group(1)}:{match.group(2)}"
                        found.set()
            if log:
                log.close()

        pumping = threading.Thread(target=pump, daemon=True, name=f"log-{self.args[0]}")
        pumping.start()
        deadline = time.monotonic() + timeout
        while not found.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pumping.join(1.0)  # the child's last lines (its error) read
                where = f"its log: {self.log_path}" if self.log_path else "its output:\n" + "".join(lines[-40:])
                raise Unavailable(f"kvmesh {self.args[0]} did not start: {_why(lines)}; {where}")
        return self

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def stop(self, timeout: float = 10.0) -> None:
        stop_all([self], timeout)

    def again(self) -> "ServiceProcess":
        """A new process of the same command at the same address and metrics address (clients and scrapers keep
        theirs), logging to the same file; started."""
        args = list(self.args)
        for flag, value in (("--listen", self.address), ("--metrics-listen", _host_port(self.metrics_url))):
            if flag in args and value:
                args[args.index(flag) + 1] = value
        return ServiceProcess(args, env=self.env, log_path=self.log_path, prefix=self.prefix, tether=self.tether,
                              on_spawn=self.on_spawn).start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _host_port(url: str) -> str:
    """``host:port`` of an ``http://host:port/...`` URL ("" for "")."""
    return url.split("//", 1)[1].split("/", 1)[0] if url else ""


def _why(lines: list[str]) -> str:
    """The child's own one-line error (kvmesh.command_line), else its last line."""
    errors = [line.strip() for line in lines if ": error: " in line]
    last = [line.strip() for line in lines if line.strip()]
    return (errors or last or ["no output"])[-1]


def stop_all(procs: Iterable[ServiceProcess], timeout: float = 10.0) -> None:
    """SIGTERM to every one at once, then waits for all; SIGKILL to those still running after ``timeout``."""
    running = [p.proc for p in procs if p.proc is not None and p.proc.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used, all threads (/proc/PID/stat utime, stime): what
    getrusage reports, readable while the process runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
