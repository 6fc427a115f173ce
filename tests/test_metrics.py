"""Every service serves Prometheus metrics: RPCs, lookups by tier, bytes, pulls, evictions, routes, tier usage.
``metrics_listen`` port 0 means any free port (as for ``listen``), empty or ``off`` no endpoint; a port that is
taken stops the start with one line before anything else is taken."""

from __future__ import annotations

import asyncio
import os
import socket
import urllib.request

import pytest

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
from kvmesh.errors import Unavailable
from kvmesh.metrics import MetricsEndpoint
from prometheus_client import CollectorRegistry


async def scrape(port: int) -> dict[str, float]:
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def test_control_plane_metrics(redis_server, key_prefix, admin_key):
    running = await serve_cp(ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url,
                                                key_prefix=key_prefix, admin_key=admin_key,
                                                metrics_listen="127.0.0.1:0"))  # any free port
    port = running.metrics.port
    assert port and running.metrics.url == f"http://127.0.0.1:{port}/metrics"
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
        assert m['kvmesh_dp_tier_used_bytes{node="m1",tier="cpu"}'] == 2 * 4096  # both slots hold a block
        assert m['kvmesh_dp_tier_capacity_bytes{node="m1",tier="cpu"}'] == 2 * 4096
    finally:
        await running.stop()


@pytest.mark.parametrize("setting", ["", "off", "OFF"])
def test_metrics_off(setting):
    endpoint = MetricsEndpoint(CollectorRegistry(), setting)
    assert endpoint.port == 0 and endpoint.url == ""


def test_metrics_port_0_is_any_free_port_as_for_listen():
    first, second = MetricsEndpoint(CollectorRegistry(), "127.0.0.1:0"), MetricsEndpoint(CollectorRegistry(),
                                                                                        "127.0.0.1:0")
    try:
        assert first.port and second.port and first.port != second.port
        assert urllib.request.urlopen(first.url).status == 200
    finally:
        first.stop()
        second.stop()


async def test_a_taken_metrics_port_stops_the_data_plane_in_one_line_before_it_takes_anything(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    key = api_keys.new_key()[1]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        config = DataPlaneConfig(node_id="m2", shm_dir=shm, block_bytes=4096, capacity_bytes=2 * 4096,
                                 lock_memory=False, api_key=key, metrics_listen=f"127.0.0.1:{taken}")
        with pytest.raises(Unavailable) as refused:
            await serve_dp(config)
        assert str(refused.value) == (f"cannot listen on 127.0.0.1:{taken} for metrics: Address already in use; "
                                      "give metrics_listen another port, port 0 for any free one, or off")
        assert list(shm.iterdir()) == []  # no tier file: the start stopped before the region was made
    running = await serve_dp(config)  # positive control: the same settings start once the port is free
    try:
        assert running.metrics.port == taken and list(shm.iterdir())
    finally:
        await running.stop()
