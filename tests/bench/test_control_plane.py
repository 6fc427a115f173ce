"""`kvmesh bench control-plane`: its simulated nodes stay holders however long a run is (real control plane)."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.config import ControlPlaneConfig
from control_plane.server import serve
from kvmesh.channels import channel
from kvmesh.v1 import control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc
from kvmesh_apps.bench.control_plane import NS, LiveNodes, check_lookup, ingest, scheduler_key

LEASE_MS = 1000  # short, so a wait of a few leases stays short; heartbeats (every 333 ms) survive a busy machine


@pytest.fixture
async def short_lease_cp(redis_server, key_prefix, admin_key):
    running = await serve(ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url, key_prefix=key_prefix,
                                             lease_ms=LEASE_MS, admin_key=admin_key))
    yield f"127.0.0.1:{running.port}"
    await running.stop()


@pytest.mark.parametrize("heartbeat", [True, False], ids=["heartbeating", "negative-control-silent"])
async def test_bench_nodes_outlive_many_leases(short_lease_cp, admin_key, heartbeat):
    """Regression: a bench run longer than the node lease (`--rounds 6000` at the 10 s default) crashed with
    IndexError, its nodes never heartbeated and stopped holding the prompt mid-run. Heartbeating nodes still
    hold every block after three leases; silent ones (the negative control) are gone, and the check says so in
    a RuntimeError."""
    key = await scheduler_key(short_lease_cp, admin_key)
    prompt = [bytes([i]) * 32 for i in range(4)]
    async with channel(short_lease_cp, admin_key) as admin_ch, channel(short_lease_cp, key) as sched_ch:
        stub = pb_grpc.ControlPlaneStub(admin_ch)
        nodes = LiveNodes(stub)
        await ingest(stub, await nodes.register(3), prompt, batch_blocks=2)
        if not heartbeat:
            await nodes.close()
        lookup = pb.LookupPrefixRequest(namespace=NS, block_hashes=prompt)
        check_lookup(await pb_grpc.ControlPlaneStub(sched_ch).LookupPrefix(lookup), len(prompt), nodes)
        await asyncio.sleep(3 * LEASE_MS / 1000)
        reply = await pb_grpc.ControlPlaneStub(sched_ch).LookupPrefix(lookup)
        try:
            if heartbeat:
                check_lookup(reply, len(prompt), nodes)
                assert nodes.heartbeats >= 3 and nodes.lease_ms == LEASE_MS
            else:
                with pytest.raises(RuntimeError, match=r"expected 3 holders of all of them, found 0 .*lease 1000 ms"):
                    check_lookup(reply, len(prompt), nodes)
        finally:
            await nodes.close()
