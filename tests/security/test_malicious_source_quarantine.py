"""Issue 19, attack 2, played for real: a malicious source tries to hold another node's memory.

The attacker holds one node key, node-b's, which only tenant B's policy allows. It runs its own source
(tests/security/rogue_source.py, a process with a real NIXL agent and a real gRPC server) registered as node-b,
and B's requests on dp2 name node-b as the source. The rogue answers every Lookup HIT, fails every send with
UNAVAILABLE (the WRITE "may still land") and answers every reclaim ``Release`` with ``settled=false``, each
time first WRITEing a marker block into the landing slots it was given (the late write held slots are for; those
slots are in the landing arena dp2 keeps for node-b, so the marker never reaches the tier).
Before the first fix each such pull quarantined fresh tier slots outside B's count: 32 of them took dp2's whole
tier, evicted tenant A's blocks, and the slots never came back. Before the second, the quarantined slots were
tier slots counted against B's quota (the rogue held part of B's quota on dp2) and, unproven after
``reclaim_force_after_ms``, made dp2 replace its NIXL agent (every peer of dp2 handshook again). Now what the
rogue's failures hold is slots of its own landing arena on dp2, and nothing else: dp2 renews that arena
``landing_renewals_per_source`` times (4; the retired ones' pages go back to the OS), then refuses the rogue.

Real Redis and control plane (in this process), a real data-plane process dp2, the rogue process; UCX on tcp.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from kvmesh.channels import channel
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from kvmesh.v1 import tenant_admin_pb2 as tpb, tenant_admin_pb2_grpc as tpb_grpc
from tenancy.model import TenantPolicy

from control_plane.config import ControlPlaneConfig
from control_plane.server import serve as serve_control_plane
from data_plane.client import DataPlaneClient, SharedTier
from kvmesh_apps.dp_process import DataPlaneProcess
from kvmesh_apps.redis_server import free_port

from tests.security.rogue_source import MARKER

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

BLOCK = 64 * 1024
SLOTS = 32
B_QUOTA_BLOCKS = 8
ARENA_BLOCKS = 6  # the landing arena dp2 keeps for each source
RENEWALS = 4  # landing_renewals_per_source's default
A = Namespace("tenant-a", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
B = Namespace("tenant-b", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


class Rogue:
    """The attacker's source process."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.security.rogue_source", "--block-bytes", str(BLOCK), "--log", str(log)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **UCX_TCP})
        for line in self.proc.stdout:
            if m := re.search(r"rogue listening on (\S+)", line):
                self.address = m.group(1)
                break
        else:
            raise AssertionError(f"the rogue source did not start (exit {self.proc.wait()})")

    def late_writes(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
async def world(redis_server, key_prefix, admin_key, tmp_path):
    cp = await serve_control_plane(ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url,
                                                      key_prefix=key_prefix, admin_key=admin_key, policy_ttl_s=0,
                                                      lease_ms=600_000))
    address = f"127.0.0.1:{cp.port}"
    tenants = cp.core.tenants
    await tenants.create_tenant(A.tenant, "A", TenantPolicy(allowed_nodes=("dp2",)))
    await tenants.create_tenant(B.tenant, "B", TenantPolicy(allowed_nodes=("dp2", "node-b"),
                                                            max_cpu_tier_bytes_per_node=B_QUOTA_BLOCKS * BLOCK))

    async def node_key(node_id: str) -> str:
        async with channel(address, admin_key) as ch:
            return (await tpb_grpc.TenantAdminStub(ch).IssueKey(tpb.IssueKeyRequest(role=tpb.ROLE_NODE,
                                                                                    node_id=node_id))).secret

    shm_dir = Path("/dev/shm") / f"kvmesh-sec-{uuid.uuid4().hex[:10]}"
    shm_dir.mkdir()
    metrics_port = free_port()
    dp2 = await asyncio.to_thread(DataPlaneProcess, "dp2", dict(
        listen="127.0.0.1:0", shm_dir=shm_dir, block_bytes=BLOCK, capacity_bytes=SLOTS * BLOCK,
        api_key=await node_key("dp2"), control_plane_address=address, metrics_listen=f"127.0.0.1:{metrics_port}",
        reclaim_retry_ms=200, reclaim_max_retry_ms=400, landing_bytes_per_source=ARENA_BLOCKS * BLOCK), UCX_TCP)
    rogue = await asyncio.to_thread(Rogue, tmp_path / "late-writes.jsonl")
    async with channel(address, await node_key("node-b")) as ch:  # the stolen key registers the rogue
        await cp_grpc.ControlPlaneStub(ch).RegisterNode(cp_pb.RegisterNodeRequest(
            node=cp_pb.NodeInfo(node_id="node-b", data_plane_address=rogue.address)))
    try:
        yield dp2, rogue, metrics_port
    finally:
        rogue.stop()
        await asyncio.to_thread(dp2.stop)
        await cp.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)


def metric(metrics_port: int, name: str) -> int:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    return int(float(m.group(1))) if m else 0


def marked_slots(tier: SharedTier) -> set[int]:
    """Slots whose bytes are the rogue's marker: where a late write landed."""
    return {s for s in range(tier.num_slots) if (tier.slot(s) == MARKER).all()}


async def commit(local: DataPlaneClient, tier: SharedTier, ns: Namespace, n: int, fill: int) -> list[bytes]:
    hashes = [os.urandom(32) for _ in range(n)]
    slots = await local.reserve(ns, hashes)
    assert -1 not in slots
    for slot in slots:
        tier.slot(slot)[:] = fill
    assert await local.commit(ns, hashes) == n
    return hashes


async def a_holds(local: DataPlaneClient, tier: SharedTier, hashes: list[bytes], fill: int) -> bool:
    """Whether A's blocks are all there, with A's bytes."""
    slots, lease = await local.acquire(A, hashes)
    intact = len(slots) == len(hashes) and all((tier.slot(s) == fill).all() for s in slots)
    if lease:
        await local.release(lease)
    return intact


async def test_a_malicious_source_holds_only_its_own_landing_arena(world):
    dp2, rogue, metrics_port = world
    async with DataPlaneClient(dp2.address, key=dp2.api_key) as local:
        tier = SharedTier.open(await local.describe_tier())
        a_blocks = await commit(local, tier, A, 4, fill=0x41)
        assert await a_holds(local, tier, a_blocks, 0x41), "positive control: A's committed blocks are on dp2"

        # The attack: B's requests on dp2 keep naming node-b.
        refused = []
        for _ in range(32):
            result = await local.pull(B, [os.urandom(32) for _ in range(4)], "node-b", rogue.address,
                                      timeout_ms=5_000)
            assert result.pulled == 0
            refused.append(result.refused)
        held = metric(metrics_port, "kvmesh_dp_quarantined_slots")
        assert held == ARENA_BLOCKS, f"{held} landing slots held"  # its whole arena, and no more
        renewals = [line for line in dp2.output if "landing arena of source node-b renewed" in line]
        assert len(renewals) == RENEWALS and f"({RENEWALS} of {RENEWALS} times" in renewals[-1], renewals
        dropped = metric(metrics_port, "kvmesh_dp_reclaimed_slots_total")  # held in the retired arenas
        assert "node-b" in refused[-1] and "landing arena" in refused[-1], refused[-1]  # refused before any Lookup
        # the attack was real: the rogue's late writes landed (DONE), in the landing arena dp2 keeps for node-b,
        # never in the tier
        t0 = time.monotonic()
        while not any(w["outcome"] == "DONE" for w in rogue.late_writes()):  # dp2 asks it every 200-400 ms
            assert time.monotonic() - t0 < 10, rogue.late_writes()
            await asyncio.sleep(0.1)
        assert not marked_slots(tier), "a late write reached dp2's tier"

        # Nothing but node-b's arena pays: A's blocks are there and every other slot of the tier is handed out,
        fill = await commit(local, tier, A, SLOTS - len(a_blocks), fill=0x42)
        assert await a_holds(local, tier, a_blocks, 0x41), "A's committed blocks were evicted"
        assert await a_holds(local, tier, fill, 0x42)
        # ... and B's whole quota is B's (those blocks take the place of A's least recent ones)
        b_blocks = [os.urandom(32) for _ in range(B_QUOTA_BLOCKS)]
        assert -1 not in await local.reserve(B, b_blocks), "the rogue's failures count against B's quota"
        await local.abort(B, b_blocks)

        # Held for good (the rogue never proves anything), and dp2 keeps its NIXL agent: the rogue's late writes,
        # through the metadata of its first handshake, still land in its arena seconds later (a replaced agent
        # would refuse them), and never in the tier, which holds A's bytes.
        await asyncio.sleep(3.0)
        later = time.time()
        while not any(w["t"] > later for w in rogue.late_writes()):
            assert time.time() - later < 10, "the rogue was never asked again:\n" + "\n".join(dp2.output)
            await asyncio.sleep(0.2)
        assert all(w["outcome"] == "DONE" for w in rogue.late_writes() if w["t"] > later), rogue.late_writes()
        assert metric(metrics_port, "kvmesh_dp_quarantined_slots") == ARENA_BLOCKS
        assert metric(metrics_port, "kvmesh_dp_reclaimed_slots_total") == dropped, "nothing was proven over"
        assert not marked_slots(tier), "a late write reached dp2's tier"
        assert await a_holds(local, tier, fill[-8:], 0x42)
        result = await local.pull(B, [os.urandom(32)], "node-b", rogue.address, timeout_ms=5_000)
        assert result.pulled == 0 and "landing arena" in result.refused, result.refused
        tier.close()
