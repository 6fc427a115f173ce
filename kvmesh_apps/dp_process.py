"""Starting data-plane processes (the benchmark and multi-node tests use it).

:class:`DataPlaneProcess` runs ``python -m data_plane.server`` with the given
flags, waits for its "listening on" line (bounded), and stops it (SIGTERM,
then SIGKILL) or kills it outright.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections import deque

_READY = re.compile(r"kvmesh data-plane (\S+) listening on (\S+)")


class DataPlaneProcess:
    def __init__(self, node_id: str, flags: dict[str, object], env: dict[str, str] | None = None,
                 ready_timeout_s: float = 60.0) -> None:
        self.node_id = node_id
        self.api_key = str(flags.get("api_key", ""))
        args = [sys.executable, "-m", "data_plane.server", "--node-id", node_id]
        for name, value in flags.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        full_env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), **(env or {})}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=full_env)
        self.output: deque[str] = deque(maxlen=200)
        self.address = self._wait_ready(ready_timeout_s)
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout_s: float) -> str:
        found: list[str] = []

        def scan() -> None:
            for line in self.proc.stdout:
                self.output.append(line.rstrip())
                m = _READY.search(line)
                if m:
                    found.append(m.group(2))
                    return

        reader = threading.Thread(target=scan, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            self.kill()
            tail = "\n".join(self.output)
            raise RuntimeError(f"data plane {self.node_id} did not start within {timeout_s}s:\n{tail}")
        return found[0]

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line.rstrip())

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()
