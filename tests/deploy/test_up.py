"""`kvmesh up`: starts the local topology, every service answers gRPC health, Ctrl-C stops it all."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_up_starts_serves_and_stops(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh_apps.cli", "up", "--data-planes", "1", "--json",
                             "--workdir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        assert serving(info["control_plane"])
        for address in info["data_planes"].values():
            assert serving(address)
        assert Path(info["admin_key_file"]).read_text().startswith("kvm_")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert list((tmp_path / "redis").glob("appendonly*"))  # Redis ran with AOF in the workdir
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
