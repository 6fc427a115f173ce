"""Helpers for the tests that run ``vllm serve`` and the ``kvmesh`` command as processes (no fixtures here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).parent.parent.parent
BIN = Path(sys.executable).parent


def process_env(workdir: Path, **extra: str) -> dict[str, str]:
    """The environment of a ``vllm serve`` / ``kvmesh`` process: this checkout's code, the venv's commands, vLLM's
    caches and sockets in ``workdir``, 1 GiB of KV cache, UCX on loopback."""
    (workdir / "vllm-rpc").mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
            "VLLM_RPC_BASE_PATH": str(workdir / "vllm-rpc"), "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "UCX_NET_DEVICES": "lo", **extra}


def wait_healthy(url: str, proc: subprocess.Popen | None, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{url} exited with {proc.returncode}:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(2)
    raise AssertionError(f"{url} not healthy after {timeout:.0f} s:\n{tail(log)}")


def complete(url: str, prompt: list[int], kv_transfer_params: dict | None = None, max_tokens: int = 4) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": kv_transfer_params})
    request = urllib.request.Request(f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.load(reply)


def metrics(url: str, prefix: str) -> dict[str, float]:
    """``name{labels}`` -> value of the Prometheus samples at ``url``/metrics whose name starts with ``prefix``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"


def stop_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to ``proc``'s process group (started with ``start_new_session``), SIGKILL to what is left of it
    after ``timeout``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + timeout
        try:
            os.killpg(proc.pid, sig)
            while time.monotonic() < deadline:
                proc.poll()  # reap it: a zombie leader would keep the group alive
                os.killpg(proc.pid, 0)
                time.sleep(0.5)
        except ProcessLookupError:
            return
