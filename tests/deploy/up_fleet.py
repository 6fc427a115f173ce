"""Driving a real `kvmesh up` from tests: start it, find its children by pid, wait for them to end, and reach
its services as its --json line says (with the admin's TLS files when the fleet runs TLS)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.channels import ClientTLS, channel

UP = [sys.executable, "-m", "kvmesh_apps.cli", "up", "--json"]


def start_up(workdir: Path | None, *args: str, env: dict | None = None,
             started: list[subprocess.Popen] | None = None) -> tuple[subprocess.Popen, dict]:
    """``kvmesh up --json ARGS [--workdir DIR]`` once it has printed its line: (process, that line). The process is
    appended to ``started`` (see :func:`stop_all_ups`)."""
    cmd = [*UP, *args] + (["--workdir", str(workdir)] if workdir else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    if started is not None:
        started.append(proc)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"kvmesh up did not start: {proc.stderr.read()}")
    return proc, json.loads(line)


def stop_all_ups(started: list[subprocess.Popen]) -> None:
    """Whatever a failed test left running: SIGTERM (up stops its fleet), SIGKILL after 10 s (its tether)."""
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out.update(int(p) for p in (task / "children").read_text().split())
    return out


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie has ended: only its exit status is left)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            running.add(pid)
    return running


def wait_gone(pids: set[int], timeout: float) -> float:
    """Seconds until none of ``pids`` runs; fails naming the survivors after ``timeout``."""
    start = time.monotonic()
    while alive(pids) and time.monotonic() - start < timeout:
        time.sleep(0.02)
    assert not alive(pids), f"still running {timeout}s later: " + ", ".join(
        Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:100] for p in alive(pids))
    return time.monotonic() - start


def client_tls(info: dict, *pair: str) -> ClientTLS | None:
    """A client's TLS from the --json line: the certificate at ``pair`` under its ``tls`` entry (default the
    admin's; ``"engines", "dp1"`` an engine's); None while the fleet runs plaintext."""
    tls = info.get("tls")
    if not tls:
        return None
    cert = functools.reduce(lambda d, k: d[k], pair or ("admin",), tls)
    return ClientTLS(tls["ca_file"], cert["cert_file"], cert["key_file"])


def admin_channel(info: dict):
    return channel(info["control_plane"], Path(info["admin_key_file"]).read_text().strip(), client_tls(info))


async def healthy(info: dict, address: str) -> bool:
    """``address`` (the control plane's or a data plane's) answers SERVING, its certificate naming its role."""
    tls = client_tls(info)
    node = next((n for n, a in info["data_planes"].items() if a == address), None)
    if tls is not None and node is not None:  # a data plane's certificate names its node id alone
        tls = dataclasses.replace(tls, server_name=node)
    async with channel(address, None, tls) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING
