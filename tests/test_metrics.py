"""Every service serves Prometheus metrics: RPCs, lookups by tier, bytes, pulls, evictions, routes."""

from __future__ import annotations

import asyncio
import os
import urllib.request

from kvmesh.channels import channel
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.redis_server import free_port
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, control_plane_pb2_grpc
from tenancy import api_keys
from tenancy.model import TenantPolicy

from control_plane.config import ControlPlaneConfig
from control_plane.server import serve as serve_cp
from data_plane.client import DataPlaneClient
from data_plane.config import DataPlaneConfig
from data_plane.server import serve as serve_dp


async def scrape(port: int) -> dict[str, float]:
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def test_control_plane_metrics(redis_server, key_prefix, admin_key):
    port = free_port()
    running = await serve_cp(ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url,
                                                key_prefix=key_prefix, admin_key=admin_key,
                                                metrics_listen=f"127.0.0.1:{port}"))
    try:
        await running.core.tenants.create_tenant("acme", "", TenantPolicy())
        ns = common_pb2.Namespace(tenant="acme", model="m", cache_config=common_pb2.CacheConfig(block_size=32))
        async with channel(f"127.0.0.1:{running.port}", admin_key) as ch:
            stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
            await stub.LookupPrefix(pb.LookupPrefixRequest(namespace=ns, token_ids=list(range(64))))
        m = await scrape(port)
        assert m['kvmesh_cp_lookup_blocks_total{result="queried"}'] == 2
        assert m['kvmesh_cp_lookup_blocks_total{result="matched"}'] == 0
        assert m['kvmesh_rpc_total{code="OK",method="LookupPrefix",service="control-plane"}'] == 1
        assert "kvmesh_cp_stale_routes_total" in m and "kvmesh_cp_stale_route_rate" in m
    finally:
        await running.stop()


async def test_data_plane_metrics(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    port = free_port()
    key = api_keys.new_key()[1]
    running = await serve_dp(DataPlaneConfig(node_id="m1", shm_dir=shm, block_bytes=4096, capacity_bytes=2 * 4096,
                                             lock_memory=False, api_key=key, metrics_listen=f"127.0.0.1:{port}"))
    ns = Namespace("acme", "m", "v1", CacheConfig(32))
    try:
        async with DataPlaneClient(running.address, key=key) as client:
            hashes = [os.urandom(32) for _ in range(3)]
            await client.reserve(ns, hashes[:2])
            await client.commit(ns, hashes[:2])
            slots, lease = await client.acquire(ns, hashes[:1] + hashes[2:])
            await client.release(lease)
            await client.reserve(ns, hashes[2:])  # evicts hashes[1], never read
        m = await scrape(port)
        assert m['kvmesh_dp_bytes_total{direction="written"}'] == 2 * 4096
        assert m['kvmesh_dp_blocks_total{caller="local",result="cpu"}'] == 1
        assert m['kvmesh_dp_blocks_total{caller="local",result="miss"}'] == 1
        assert m['kvmesh_dp_evictions_total{tier="cpu"}'] == 1
        assert m["kvmesh_dp_evictions_before_reuse_total"] == 1
    finally:
        await running.stop()
