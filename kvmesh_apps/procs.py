"""Starting kvmesh services as child processes (benchmarks, the demo, `kvmesh up`, tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.errors import Unavailable

_LISTENING = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class ServiceProcess:
    """A ``kvmesh <command>`` child whose first 'listening on host:port' line gives its address."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    prefix: list[str] = field(default_factory=list)  # e.g. kvmesh_apps.netns.Network.prefix(host)
    proc: subprocess.Popen | None = None
    address: str = ""

    def start(self, timeout: float = 60.0) -> "ServiceProcess":
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "kvmesh_apps.cli", *self.args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = threading.Event()
        lines: list[str] = []

        def pump() -> None:
            log = open(self.log_path, "w") if self.log_path else None
            for line in self.proc.stdout:
                if log:
                    log.write(line)
                    log.flush()
                if not found.is_set():
                    lines.append(line)
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

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _why(lines: list[str]) -> str:
    """The child's own one-line error (kvmesh.command_line), else its last line."""
    errors = [line.strip() for line in lines if ": error: " in line]
    last = [line.strip() for line in lines if line.strip()]
    return (errors or last or ["no output"])[-1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used, all threads (/proc/PID/stat utime, stime): what
    getrusage reports, readable while the process runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
