"""grpc's own services on every kvmesh server (health, reflection), asked without a key: a malformed request is
refused in one line, not answered UNKNOWN with a traceback in the service's log per call, and Health.Watch holds
no more than MAX_HEALTH_WATCHES streams, for the server's own service names only."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.grpc_server import start_server
from kvmesh.request_gate import MAX_HEALTH_WATCHES

BAD_UTF8 = b"\x0a\x01\xff"  # field 1 (a string) holding invalid UTF-8


@pytest.fixture
async def server():
    running = await start_server("127.0.0.1:0", [])
    try:
        yield f"127.0.0.1:{running.port}"
    finally:
        await running.stop(0)


async def test_malformed_health_and_reflection_requests_are_refused_without_a_traceback(server, caplog):
    caplog.set_level(logging.ERROR)
    async with grpc.aio.insecure_channel(server) as ch:
        assert (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
            health_pb2.HealthCheckResponse.SERVING  # control
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ch.unary_unary("/grpc.health.v1.Health/Check")(BAD_UTF8, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid grpc.health.v1.HealthCheckRequest" in err.value.details()
        reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = [a async for a in reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)]
        assert "grpc.health.v1.Health" in {s.name for s in answers[0].list_services_response.service}  # control
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(
                    iter([BAD_UTF8]), timeout=5):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.exc_info]


async def test_health_watches_are_bounded_and_only_for_the_servers_services(server):
    async with grpc.aio.insecure_channel(server) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        made_up = health.Watch(health_pb2.HealthCheckRequest(service="made-up"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await made_up.read()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(MAX_HEALTH_WATCHES)]
        for watch in watches:  # control: the server's own health, watched
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        one_more = health.Watch(health_pb2.HealthCheckRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await one_more.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        watches.pop().cancel()
        await asyncio.sleep(0.2)
        again = health.Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING  # room again
        for watch in [*watches, again]:
            watch.cancel()
