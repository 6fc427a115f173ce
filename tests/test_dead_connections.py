"""A frozen server (SIGSTOP: its kernel still ACKs TCP, only HTTP/2 pings show it is gone) ends a call with no
deadline, and a stream, within KEEPALIVE_MS + PING_TIMEOUT_MS on a kvmesh channel (kvmesh.grpc_server.channel_options).

Found in review: with keepalive_time_ms and keepalive_timeout_ms alone, gRPC waited 60 s for a ping's answer
(grpc.http2.ping_timeout_ms' default), so a call with no deadline on an open channel took 60 s to fail, and a call
opening a new connection 20 s: the bound on the publisher's RegisterNode and event stream, a scheduler's
WatchBlockMap and LookupPrefixBatches streams, and every `kvmesh admin` call against a frozen control plane.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.grpc_server import KEEPALIVE_MS, PING_TIMEOUT_MS, channel_options

SERVER = """
import asyncio
import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health
from kvmesh.grpc_server import server_options

async def main():
    server = grpc.aio.server(options=server_options())
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""
BOUND_S = (KEEPALIVE_MS + PING_TIMEOUT_MS) / 1000 + 3.0  # with room for a loaded machine


@pytest.fixture
def frozen_later():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        yield proc, int(proc.stdout.readline())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


async def test_a_call_and_a_stream_to_a_frozen_server_end_within_the_keepalive_bound(frozen_later):
    proc, port = frozen_later
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        ok = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # control: it answers while it runs
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest())  # a stream, open when the server freezes
        await watch.read()
        os.kill(proc.pid, signal.SIGSTOP)
        for what, call in (("the open stream", watch.read()),
                           ("a call with no deadline", stub.Check(health_pb2.HealthCheckRequest())),
                           ("the next call (a new connection)", stub.Check(health_pb2.HealthCheckRequest()))):
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            took = time.monotonic() - started
            assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, (what, failed.value)
            assert took < BOUND_S, f"{what} took {took:.1f} s to fail against a frozen server (bound {BOUND_S} s)"
