"""Authentication off the hot path: API keys cached in process, revocation pushed to every replica.

Two real control-plane replicas on one Redis. The bound: a revocation reaches every replica by pub/sub
(at once), and a lost notification is bounded by ``auth_cache_ttl_s``."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvmesh.channels import channel
from kvmesh.v1 import common_pb2, control_plane_pb2_grpc, tenant_admin_pb2 as tpb, tenant_admin_pb2_grpc
from tenancy.key_cache import KeyCache
from tenancy.keys import TenantKeys


async def _refused_within(stub, seconds: float) -> float:
    """Seconds until ``stub`` is refused UNAUTHENTICATED (fails the test after ``seconds``)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            await stub.Ping(common_pb2.PingRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    pytest.fail(f"still accepted after {seconds} s")


@pytest.fixture
async def replicas(cp_config):
    from control_plane.server import serve

    running = [await serve(cp_config.model_copy(update={"auth_cache_ttl_s": ttl})) for ttl in (600.0, 600.0)]
    yield running
    for r in running:
        await r.stop()


async def test_a_key_revoked_on_one_replica_is_refused_by_the_other_at_once(replicas, admin_key):
    a, b = (f"127.0.0.1:{r.port}" for r in replicas)
    async with channel(a, admin_key) as admin_ch:
        admin = tenant_admin_pb2_grpc.TenantAdminStub(admin_ch)
        await admin.CreateTenant(tpb.CreateTenantRequest(tenant_id="tenant-a"))
        issued = await admin.IssueKey(tpb.IssueKeyRequest(role=tpb.ROLE_SCHEDULER, tenant_id="tenant-a"))
        async with channel(b, issued.secret) as b_ch:
            on_b = control_plane_pb2_grpc.ControlPlaneStub(b_ch)
            for _ in range(3):  # positive control: replica B accepts the key, and now serves it from its cache
                await on_b.Ping(common_pb2.PingRequest(), timeout=5)
            assert replicas[1].key_changes.subscribed.is_set() and len(replicas[1].key_changes._cache) >= 1
            await admin.RevokeKey(tpb.RevokeKeyRequest(key_id=issued.key.key_id))
            # The TTL is 600 s: only the pushed notification can make B refuse within this bound.
            await _refused_within(on_b, 5.0)


async def test_a_lost_notification_is_bounded_by_the_cache_ttl(cp_config, admin_key, redis_server):
    """Revoke behind the control plane's back (no notification): the cached key dies with its entry."""
    from control_plane.server import serve

    running = await serve(cp_config.model_copy(update={"auth_cache_ttl_s": 1.0}))
    try:
        address = f"127.0.0.1:{running.port}"
        async with channel(address, admin_key) as admin_ch:
            admin = tenant_admin_pb2_grpc.TenantAdminStub(admin_ch)
            await admin.CreateTenant(tpb.CreateTenantRequest(tenant_id="tenant-a"))
            issued = await admin.IssueKey(tpb.IssueKeyRequest(role=tpb.ROLE_SCHEDULER, tenant_id="tenant-a"))
        async with channel(address, issued.secret) as ch:
            stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
            await stub.Ping(common_pb2.PingRequest(), timeout=5)  # cached now
            import redis.asyncio as aioredis

            r = aioredis.Redis.from_url(redis_server.url)
            try:
                await r.hset(TenantKeys(cp_config.key_prefix).api_key(issued.key.key_id), "revoked", 1)
            finally:
                await r.aclose()
            await stub.Ping(common_pb2.PingRequest(), timeout=5)  # the cache still vouches for it (no push) ...
            assert await _refused_within(stub, 10.0) <= 10.0  # ... until its entry expires (1 s, loaded machine)
    finally:
        await running.stop()


async def test_cache_serves_only_while_notifications_flow_and_a_racing_revocation_wins():
    reads = []
    record = {"k": "v1"}

    async def get(key_id):
        reads.append(key_id)
        return record.get(key_id)

    now = [0.0]
    cache = KeyCache(get, ttl_s=10.0, clock=lambda: now[0])
    assert await cache.get("k") == "v1" and await cache.get("k") == "v1"
    assert len(reads) == 2  # not live (no subscription): every call reads the store
    cache.live = True
    await cache.get("k")
    await cache.get("k")
    assert len(reads) == 3  # live: the second call is a hit
    now[0] = 10.5
    await cache.get("k")
    assert len(reads) == 4  # expired after ttl_s

    async def slow_get(key_id):  # a revocation lands while the read is in flight
        value = record.get(key_id)
        racing.drop(key_id)
        return value

    racing = KeyCache(slow_get, ttl_s=10.0, clock=lambda: now[0])
    racing.live = True
    await racing.get("k")
    assert len(racing) == 0  # the read that raced a revocation is not cached
    plain = KeyCache(get, ttl_s=10.0, clock=lambda: now[0])
    plain.live = True
    await plain.get("k")
    assert len(plain) == 1  # negative control: the same read without a revocation is cached
