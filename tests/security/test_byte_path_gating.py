"""Attack 2 of issue 9, played for real: a peer holding a grant for tenant B tries to read tenant A's KV bytes.

Real data-plane processes and a real NIXL agent in this (attacker) process, UCX forced onto tcp (the transport
between hosts here). Positive control: the same attack against a source that serves one-sided READs
(``serve_peer_reads``) does read A's bytes, so the probe is real; and a consumer with A's grant pulls A's bytes
from the gated source. Gating: a default source hands out no NIXL metadata, and only WRITEs blocks of the
namespace a current grant covers into the consumer's own slots.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.namespace import CacheConfig, Namespace
from tenancy import api_keys
from tenancy.grants import Grant, GrantSigner
from tenancy.peer_proof import NodeIdentity, encode_public_key

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.server import TRANSFERS_HEALTH
from data_plane.types import LookupStatus
from kvmesh_apps.dp_process import DataPlaneProcess

from tests.agent_challenge import UCX_TCP, handshake, nixl_agent_with_buffer

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

BLOCK = 64 * 1024
N = 4
TENANT_A = Namespace("tenant-a", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
TENANT_B = Namespace("tenant-b", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()


class Fleet:
    def __init__(self, shm_dir: Path) -> None:
        self.signer = GrantSigner.generate()
        self.shm_dir = shm_dir
        self.procs: list[DataPlaneProcess] = []

    def start(self, node_id: str, **env: str) -> DataPlaneProcess:
        flags = dict(listen="127.0.0.1:0", shm_dir=self.shm_dir, block_bytes=BLOCK, capacity_bytes=32 * BLOCK,
                     lease_sweep_ms=50, api_key=api_keys.new_key()[1],
                     grant_public_key=base64.b64encode(self.signer.public_key).decode())
        proc = DataPlaneProcess(node_id, flags, env={**UCX_TCP, **env})
        self.procs.append(proc)
        wait_transfers_ready(proc)
        return proc

    def grant(self, consumer_public_key: bytes, consumer: str, source: str, ns: Namespace,
              ttl_ms: int = 60_000, tenant_epoch: str = "") -> bytes:
        return self.signer.sign(Grant(ns.tenant, ns.fingerprint, consumer, encode_public_key(consumer_public_key),
                                      source, int(time.time() * 1000) + ttl_ms, tenant_epoch=tenant_epoch))


def wait_transfers_ready(proc: DataPlaneProcess, timeout_s: float = 120.0) -> None:
    """Waits for the node's NIXL agent (its TRANSFERS_HEALTH status): the "listening" line comes first, and on a
    loaded host the agent can take longer than a first peer call's deadline to start."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(proc.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while health.Check(health_pb2.HealthCheckRequest(service=TRANSFERS_HEALTH), timeout=10).status != \
                health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, f"{proc.node_id}'s NIXL agent did not start in {timeout_s}s"
            time.sleep(0.05)


def as_peer(identity: NodeIdentity, source: DataPlaneProcess) -> DataPlaneClient:
    """A client that calls ``source`` as a peer: no API key, a proof by ``identity`` per call."""
    return DataPlaneClient(source.address, peer_proof=lambda g, method: identity.proof(g, method, source.node_id))


async def peer_key_of(node: DataPlaneProcess) -> bytes:
    async with DataPlaneClient(node.address, key=node.api_key) as owner:
        return (await owner.describe_tier()).peer_public_key


@pytest.fixture
def fleet():
    shm_dir = Path("/dev/shm") / f"kvmesh-sec-{uuid.uuid4().hex[:10]}"
    shm_dir.mkdir()
    fleet = Fleet(shm_dir)
    yield fleet
    for proc in fleet.procs:
        if proc.proc.poll() is None:
            proc.stop()
    shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.fixture
def attacker():
    """The attacker's NIXL agent in this process, with a buffer to read (or be written) into."""
    with nixl_agent_with_buffer("attacker", N * BLOCK) as agent_and_buffer:
        yield agent_and_buffer


async def store(source: DataPlaneProcess, ns: Namespace, n: int = N) -> tuple[list[bytes], list[bytes]]:
    """Commits n blocks of random (secret) bytes on ``source``; their hashes and contents."""
    hashes, secrets = [os.urandom(32) for _ in range(n)], [os.urandom(BLOCK) for _ in range(n)]
    async with DataPlaneClient(source.address, key=source.api_key) as owner:
        tier = SharedTier.open(await owner.describe_tier())
        for slot, data in zip(await owner.reserve(ns, hashes), secrets):
            tier.slot(slot)[:] = np.frombuffer(data, dtype=np.uint8)
        tier.close()
        await owner.commit(ns, hashes)
    return hashes, secrets


async def addresses(fleet: Fleet, source: DataPlaneProcess, hashes: list[bytes], serves_reads: bool) -> list[int]:
    """Where A's blocks lie in the source's memory (the attacker is granted knowing them: slots are guessable),
    read from the source process's memory map; a peer's Lookup answer names them only from a source that serves
    peer READs (serve_peer_reads), and names none otherwise."""
    oracle_id = NodeIdentity()
    grant = fleet.grant(oracle_id.public_key, "oracle", source.node_id, TENANT_A)
    async with as_peer(oracle_id, source) as oracle:
        answer, _ = await oracle.lookup(TENANT_A, hashes, grant=grant)
        await oracle.release(answer.lease_id, grant=grant)
    assert answer.statuses == [LookupStatus.HIT] * len(hashes)
    async with DataPlaneClient(source.address, key=source.api_key) as owner:
        slots, lease = await owner.acquire(TENANT_A, hashes)
        await owner.release(lease)
    maps = Path(f"/proc/{source.proc.pid}/maps").read_text().splitlines()
    base = int(next(line for line in maps if line.endswith(".tier") and source.node_id in line).split("-")[0], 16)
    where = [base + slot * BLOCK for slot in slots]
    assert answer.addrs == (where if serves_reads else [0] * len(hashes)), "a gated source names no address"
    return where


def nixl_read(agent, buf: np.ndarray, peer: str, addrs: list[int]) -> str:
    """The attacker's one-sided READ of each address into its buffer: the final state, or the error."""
    local = [(buf.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(len(addrs))]
    remote = [(a, BLOCK, 0) for a in addrs]
    try:
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                       agent.get_xfer_descs(remote, "DRAM"), peer)
    except Exception as exc:  # noqa: BLE001 - what the attacker's NIXL says
        return f"refused: {type(exc).__name__}"
    state = agent.transfer(handle)
    deadline = time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    handle.release()
    return state


async def test_a_grant_for_tenant_b_reads_none_of_tenant_as_bytes(fleet, attacker):
    agent, buf = attacker
    open_source = fleet.start("src-open", KVMESH_DP_SERVE_PEER_READS="true")
    gated = fleet.start("src-gated")
    me = NodeIdentity()  # the attacker's own peer key: its grants (for tenant B) bind it

    # Control: a source that hands out its metadata is read by anyone who handshook with any grant.
    hashes, secrets = await store(open_source, TENANT_A)
    addrs = await addresses(fleet, open_source, hashes, serves_reads=True)
    async with as_peer(me, open_source) as peer:
        hs = await peer.exchange_agent_metadata("attacker", agent.get_agent_metadata(), BLOCK,
                                                grant=fleet.grant(me.public_key, "attacker", "src-open", TENANT_B))
    assert hs.agent_metadata, "the ungated source hands out its metadata"
    remote = agent.add_remote_agent(hs.agent_metadata)
    assert nixl_read(agent, buf, remote, addrs) == "DONE"
    assert [bytes(buf[i * BLOCK:(i + 1) * BLOCK]) for i in range(N)] == secrets, "the probe reads A's bytes"
    agent.remove_remote_agent(remote)

    # The gated source: the same attacker, the same kind of grant, gets no metadata and no bytes.
    buf[:] = 0
    hashes, secrets = await store(gated, TENANT_A)
    addrs = await addresses(fleet, gated, hashes, serves_reads=False)
    grant_b = fleet.grant(me.public_key, "attacker", "src-gated", TENANT_B)
    async with as_peer(me, gated) as peer:
        hs = await peer.exchange_agent_metadata("attacker", agent.get_agent_metadata(), BLOCK, grant=grant_b)
        assert hs.agent_metadata == b"", "a gated source hands out no rkey"
        assert nixl_read(agent, buf, hs.agent_name, addrs).startswith("refused"), "no metadata: nothing to READ"
        landing = [buf.ctypes.data + i * BLOCK for i in range(N)]
        for call in (peer.lookup(TENANT_A, hashes, grant=grant_b),  # look A's blocks up, or have them sent
                     peer.send(TENANT_A, "0" * 32, hashes, landing, grant=grant_b)):  # with B's grant
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "another namespace" in err.value.details()
        answer, _ = await peer.lookup(TENANT_B, hashes, grant=grant_b)  # A's hashes as B's
        assert answer.statuses == [LookupStatus.MISS] * N and not answer.lease_id
    assert not buf.any(), "not one byte of A's blocks reached the attacker"

    # Positive control: a consumer node with A's grant pulls A's bytes from the gated source.
    consumer = fleet.start("consumer")
    grant_a = fleet.grant(await peer_key_of(consumer), "consumer", "src-gated", TENANT_A)
    async with DataPlaneClient(consumer.address, key=consumer.api_key) as local:
        result = await local.pull(TENANT_A, hashes, "src-gated", gated.address, grant=grant_a)
        assert result.pulled == N
        slots, lease = await local.acquire(TENANT_A, hashes)
        tier = SharedTier.open(await local.describe_tier())
        assert [bytes(tier.slot(s)) for s in slots] == secrets
        tier.close()
        await local.release(lease)


async def test_a_handshake_under_another_nodes_name_is_refused(fleet, attacker):
    """The gated source WRITEs to the agent registered under the grant's consumer: nobody can take that name."""
    agent, _ = attacker
    gated = fleet.start("src-gated")
    me = NodeIdentity()
    async with as_peer(me, gated) as peer:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.exchange_agent_metadata("victim", agent.get_agent_metadata(), BLOCK,
                                               grant=fleet.grant(me.public_key, "attacker", "src-gated", TENANT_A))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        hs = await peer.exchange_agent_metadata("attacker", agent.get_agent_metadata(), BLOCK,
                                                grant=fleet.grant(me.public_key, "attacker", "src-gated", TENANT_A))
        assert hs.node_id == "src-gated"  # control: under its own name it handshakes


async def test_bytes_stop_when_the_grant_expires(fleet):
    """Every send re-checks the grant: the bound after expiry is zero (revocation and policy changes reach
    a node as grants the control plane no longer issues, so within the grant TTL)."""
    gated = fleet.start("src-gated")
    consumer = fleet.start("consumer")
    warm, _ = await store(gated, TENANT_A)
    first, _ = await store(gated, TENANT_A)
    later, _ = await store(gated, TENANT_A)
    ttl_ms = 4_000
    consumer_key = await peer_key_of(consumer)
    async with DataPlaneClient(consumer.address, key=consumer.api_key) as local:
        # both NIXL agents up and handshaken first (on a loaded host that alone can outlast a short grant)
        long_lived = fleet.grant(consumer_key, "consumer", "src-gated", TENANT_A)
        assert (await local.pull(TENANT_A, warm, "src-gated", gated.address, grant=long_lived)).pulled == N
        grant = fleet.grant(consumer_key, "consumer", "src-gated", TENANT_A, ttl_ms=ttl_ms)
        expires = time.time() + ttl_ms / 1000
        assert (await local.pull(TENANT_A, first, "src-gated", gated.address, grant=grant)).pulled == N
        await asyncio.sleep(max(0.0, expires - time.time()) + 0.2)
        assert (await local.pull(TENANT_A, later, "src-gated", gated.address, grant=grant)).pulled == 0
        fresh = fleet.grant(consumer_key, "consumer", "src-gated", TENANT_A)
        assert (await local.pull(TENANT_A, later, "src-gated", gated.address, grant=fresh)).pulled == N


async def test_a_lease_is_sent_only_to_the_consumer_that_took_it_in_its_namespace(fleet, attacker):
    """The send names the lease of the consumer's own Lookup: the source WRITEs the blocks pinned under it
    without looking them up again, so the lease must not serve anyone else. The attacker has the victim's lease
    id (say, read off a link without TLS) and grants of its own, for the victim's tenant and for another one:
    nothing is written to it, and the lease is left untouched; nor does the victim's own grant for another
    namespace, or for A under another tenant epoch, send it. Positive control: the victim's send of the same
    lease afterwards writes A's bytes into the victim's buffer (once: the send ends the lease)."""
    agent, buf = attacker
    gated = fleet.start("src-gated")
    hashes, secrets = await store(gated, TENANT_A)
    victim_id, me = NodeIdentity(), NodeIdentity()
    victim_grant = fleet.grant(victim_id.public_key, "victim", "src-gated", TENANT_A)
    with nixl_agent_with_buffer("victim", N * BLOCK) as (victim_agent, victim_buf):
        async with as_peer(victim_id, gated) as victim, as_peer(me, gated) as peer:
            await handshake(victim, "victim", victim_agent, victim_grant, BLOCK)
            answer, _ = await victim.lookup(TENANT_A, hashes, lease_ms=60_000, grant=victim_grant)
            assert answer.statuses == [LookupStatus.HIT] * N and answer.lease_id
            stolen = answer.lease_id

            landing = [buf.ctypes.data + i * BLOCK for i in range(N)]
            grant_a = fleet.grant(me.public_key, "attacker", "src-gated", TENANT_A)  # another consumer of A
            grant_b = fleet.grant(me.public_key, "attacker", "src-gated", TENANT_B)  # another namespace
            await handshake(peer, "attacker", agent, grant_a, BLOCK)
            assert await peer.send(TENANT_A, stolen, hashes, landing, grant=grant_a) == (0, BLOCK)
            assert await peer.send(TENANT_B, stolen, hashes, landing, grant=grant_b) == (0, BLOCK)
            assert await peer.send(TENANT_A, os.urandom(16).hex(), hashes, landing, grant=grant_a) == (0, BLOCK)
            await peer.release(stolen, grant=grant_a)  # nor can it end the victim's lease
            await asyncio.sleep(0.2)
            assert not buf.any(), "not one byte reached the attacker"
            # the lease's own holder, under a grant for another namespace (e.g. after A's policy dropped it)
            victim_b = fleet.grant(victim_id.public_key, "victim", "src-gated", TENANT_B)
            victim_landing = [victim_buf.ctypes.data + i * BLOCK for i in range(N)]
            assert await victim.send(TENANT_B, stolen, hashes, victim_landing, grant=victim_b) == (0, BLOCK)
            await asyncio.sleep(0.2)
            assert not victim_buf.any(), "a lease serves only the namespace it was taken in"
            # ... or a grant for A issued after A was deleted and re-created (another tenant epoch)
            victim_new_a = fleet.grant(victim_id.public_key, "victim", "src-gated", TENANT_A, tenant_epoch="e2")
            assert await victim.send(TENANT_A, stolen, hashes, victim_landing, grant=victim_new_a) == (0, BLOCK)
            await asyncio.sleep(0.2)
            assert not victim_buf.any(), "a lease serves only the tenant epoch it was taken under"

            assert await victim.send(TENANT_A, stolen, hashes, victim_landing, grant=victim_grant) == (N, BLOCK)
            assert [bytes(victim_buf[i * BLOCK:(i + 1) * BLOCK]) for i in range(N)] == secrets
            victim_buf[:] = 0
            assert await victim.send(TENANT_A, stolen, hashes, victim_landing, grant=victim_grant) == (0, BLOCK)
            assert not victim_buf.any(), "a lease is sent once"
