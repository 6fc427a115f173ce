"""A server holds at most ``max_connections`` connections, and closes one with no call for IDLE_CONNECTION_MS
(found by the black-box judge: with dp1's certificate, ~20,000 handshaken connections that never called took
every descriptor of a `kvmesh up` control plane, +1.3 GiB, and dp2's new connections went unserved until they
were released). Connections past the cap are closed as they arrive; idle ones are closed; a client is served
again afterwards (positive control)."""

from __future__ import annotations

import asyncio
import resource
import socket
import time

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh import grpc_server
from kvmesh.channels import channel
from tests.security.blackbox_probe import HTTP2_PREFACE


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(HTTP2_PREFACE)
    sock.setblocking(False)
    return sock


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (what it sent before, its SETTINGS or a GOAWAY, is read and dropped)."""
    while True:
        try:
            if sock.recv(65536) == b"":
                return True
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True


async def wait_closed(socks: list[socket.socket], within_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if all(closed(s) for s in socks):
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    return None


async def check(port: int) -> str:
    async with channel(f"127.0.0.1:{port}", None) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except Exception as exc:  # noqa: BLE001 - the code is what is asserted
            return type(exc).__name__
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_connections_past_the_cap_are_closed_at_once_and_idle_ones_in_time(monkeypatch):
    monkeypatch.setattr(grpc_server, "IDLE_CONNECTION_MS", 3_000)
    running = await grpc_server.start_server("127.0.0.1:0", [], max_connections=4)
    try:
        held = [connect(running.port) for _ in range(4)]
        await asyncio.sleep(0.3)
        past = [connect(running.port) for _ in range(3)]
        assert await wait_closed(past, 1.0) is not None, "connections past the cap are still open"
        assert not any(closed(s) for s in held), "a connection within the cap was closed before it idled"
        assert await check(running.port) == "AioRpcError", "a fifth connection was served while four were held"
        assert await wait_closed(held, 6.0) is not None, "idle connections still open 6 s after the idle timeout"
        assert await check(running.port) == "SERVING"  # positive control: room again once the idle ones went
        for s in held + past:
            s.close()
    finally:
        await running.stop(0)


def test_the_cap_is_fitted_to_the_open_file_limit(monkeypatch):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert grpc_server.fit_connections(64) == 64  # the real limit, raised if it was short
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 64 + grpc_server.SPARE_DESCRIPTORS
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    set_to = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 3072))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: set_to.append(limits))
    assert grpc_server.fit_connections(4096) == 3072 - grpc_server.SPARE_DESCRIPTORS  # lowered to fit
    assert set_to == [(3072, 3072)]  # the soft limit raised as far as the hard one allows
