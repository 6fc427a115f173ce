"""Issue 19, item 1 and "landing agent poisoned": where a source WRITEs is bound to who asked.

Played for real: a control plane (in this process) on a real Redis, data-plane processes dp1 and dp2 (real NIXL,
UCX on tcp), tenant A allowed on dp1 and dp2, tenant B on dp1, dp2 and node-b. The attacker holds node-b's node
key (stolen) and only that: it runs its own data-plane server in this process, registered with the control plane
as node-b, and its own NIXL agent. A B request on dp2 naming node-b as its source makes dp2 hand node-b its
NIXL agent metadata (the rogue server records it). The attacker then, with grants the control plane issues to
node-b's key:

* hands dp2's metadata to dp1 as its own and has dp1 WRITE B's block over A's committed block on dp2;
* re-handshakes at dp1 so that dp1 drops dp2's endpoint (dp2's next pull from dp1 would miss);
* READs and WRITEs dp2's tier itself with its own NIXL agent, with the metadata dp2 handed it as a source it
  pulled from: that metadata describes node-b's landing arena on dp2 only (data_plane/landing.py), so NIXL
  refuses every address of the tier, and the arena holds no byte another source sent.

And a consumer's own handshake, sent in corrupted copies, must not make dp1 refuse its real metadata after.
Each positive control shows the target was there and reachable first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import struct
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvmesh.channels import channel
from kvmesh.grpc_server import ServiceBinding, start_server
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from kvmesh.v1 import data_plane_pb2 as dp_pb, data_plane_pb2_grpc as dp_grpc
from kvmesh.v1 import tenant_admin_pb2 as tpb, tenant_admin_pb2_grpc as tpb_grpc
from tenancy.auth import auth_metadata
from tenancy.peer_proof import NodeIdentity

from control_plane.config import ControlPlaneConfig
from control_plane.publisher import EventPublisher, NodeInfo
from control_plane.server import serve as serve_control_plane
from data_plane.client import DataPlaneClient, SharedTier
from data_plane.nixl_metadata import read_agent_metadata
from kvmesh_apps.dp_process import DataPlaneProcess

from tests.agent_challenge import UCX_TCP, handshake, nixl_agent_with_buffer

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

BLOCK = 64 * 1024
N = 2
NS_A = Namespace("tenant-a", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
NS_B = Namespace("tenant-b", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()


class RogueDataPlane(dp_grpc.DataPlaneServicer):
    """node-b's data plane as the attacker runs it: records the NIXL metadata consumers hand over, holds nothing."""

    def __init__(self) -> None:
        self.metadata: dict[str, bytes] = {}  # consumer node id -> its agent metadata
        self.answers: dict[str, bytes] = {}  # consumer node id -> the challenge answer it sent
        self.claim_agent = ""  # set: answer handshakes as this agent, with a challenge "sent"

    async def ExchangeAgentMetadata(self, request, context):
        if request.agent_challenge_answer:
            self.answers[request.node_id] = request.agent_challenge_answer
        elif request.agent_metadata:
            self.metadata[request.node_id] = request.agent_metadata
        return dp_pb.ExchangeAgentMetadataResponse(
            node_id="node-b", agent_name=self.claim_agent or f"node-b-{uuid.uuid4().hex[:8]}", block_bytes=BLOCK,
            agent_challenge_sent=bool(self.claim_agent))

    async def Lookup(self, request, context):  # the consumer forgets node-b: its next pull handshakes again
        await context.abort(grpc.StatusCode.UNAVAILABLE, "node-b holds nothing")


class World:
    def __init__(self, cp, admin_key: str, shm_dir: Path) -> None:
        self.cp, self.admin_key, self.shm_dir = cp, admin_key, shm_dir
        self.address = f"127.0.0.1:{cp.port}"
        self.procs: list[DataPlaneProcess] = []
        self.keys: dict[str, str] = {}

    async def node_key(self, node_id: str) -> str:
        async with channel(self.address, self.admin_key) as ch:
            reply = await tpb_grpc.TenantAdminStub(ch).IssueKey(tpb.IssueKeyRequest(role=tpb.ROLE_NODE,
                                                                                     node_id=node_id))
        self.keys[node_id] = reply.secret
        return reply.secret

    async def registered(self, node_id: str) -> None:
        for _ in range(200):  # registration is asynchronous
            if any(n.node.node_id == node_id and n.live for n in await self.cp.core.block_map.list_nodes()):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{node_id} never registered")

    async def data_plane(self, node_id: str) -> DataPlaneProcess:
        proc = await asyncio.to_thread(DataPlaneProcess, node_id, dict(
            listen="127.0.0.1:0", shm_dir=self.shm_dir, block_bytes=BLOCK, capacity_bytes=16 * BLOCK,
            lease_sweep_ms=50, api_key=await self.node_key(node_id), control_plane_address=self.address), UCX_TCP)
        self.procs.append(proc)
        await self.registered(node_id)
        return proc

    async def grant(self, node_id: str, ns: Namespace, source: str, public_key: bytes) -> bytes:
        """A pull grant the control plane issues to ``node_id``'s key, bound to ``public_key``."""
        async with channel(self.address, self.keys[node_id]) as ch:
            reply = await cp_grpc.ControlPlaneStub(ch).IssuePullGrant(cp_pb.IssuePullGrantRequest(
                namespace=ns.to_proto(), source_node_id=source, consumer_public_key=public_key))
        return reply.token


@pytest.fixture
async def world(redis_server, key_prefix, admin_key):
    cp = await serve_control_plane(ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url,
                                                      key_prefix=key_prefix, admin_key=admin_key, policy_ttl_s=0))
    shm_dir = Path("/dev/shm") / f"kvmesh-sec-{uuid.uuid4().hex[:10]}"
    shm_dir.mkdir()
    w = World(cp, admin_key, shm_dir)
    async with channel(w.address, admin_key) as ch:
        admin = tpb_grpc.TenantAdminStub(ch)
        await admin.CreateTenant(tpb.CreateTenantRequest(tenant_id=NS_A.tenant, policy=tpb.TenantPolicy(
            allowed_nodes=["dp1", "dp2"])))
        await admin.CreateTenant(tpb.CreateTenantRequest(tenant_id=NS_B.tenant, policy=tpb.TenantPolicy(
            allowed_nodes=["dp1", "dp2", "node-b"])))
    yield w
    for proc in w.procs:  # in a thread: a stopping data plane deregisters with the control plane on this loop
        if proc.proc.poll() is None:
            await asyncio.to_thread(proc.stop)
    await cp.stop()
    shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.fixture
async def rogue(world):
    """node-b's data plane, run by the attacker with node-b's stolen key and registered under it."""
    servicer = RogueDataPlane()
    server = await start_server("127.0.0.1:0", [ServiceBinding(servicer, dp_grpc.add_DataPlaneServicer_to_server,
                                                               "kvmesh.v1.DataPlane")])
    address = f"127.0.0.1:{server.port}"
    publisher = EventPublisher(world.address, NodeInfo("node-b", address), lambda: (),
                               metadata=auth_metadata(await world.node_key("node-b")))
    await publisher.start()
    await world.registered("node-b")
    yield servicer, address
    await publisher.stop()
    await server.stop()


def nixl_xfer(agent, op: str, buf: np.ndarray, peer: str, addr: int, nbytes: int = BLOCK) -> str:
    """The attacker's one-sided READ or WRITE of ``nbytes`` between its buffer and ``addr`` of ``peer``: the final
    state, or "refused" when NIXL will not build the transfer (the address is outside what the metadata
    describes)."""
    try:
        handle = agent.initialize_xfer(op, agent.get_xfer_descs([(buf.ctypes.data, nbytes, 0)], "DRAM"),
                                       agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM"), peer)
    except Exception:  # noqa: BLE001 - NIXL raises its own classes (NIXL_ERR_NOT_FOUND)
        return "refused"
    state = agent.transfer(handle)
    for _ in range(100_000):
        if state != "PROC":
            break
        state = agent.check_xfer_state(handle)
    handle.release()
    return state


def renamed(metadata: bytes, name: str) -> bytes:
    """``metadata`` with its agent name replaced: another agent's worker address and memory under ``name``."""
    length = struct.unpack_from("<Q", metadata, len(b"nixlSerDes|Agent"))[0]
    rest = metadata[len(b"nixlSerDes|Agent") + 8 + length + 1:]
    return b"nixlSerDes|Agent" + struct.pack("<Q", len(name)) + name.encode() + b"|" + rest


def tier_address(node: DataPlaneProcess) -> int:
    """Where the node's CPU tier (slot 0 first) is mapped in its process, as an attacker who guessed it right
    would know it (read here from /proc/<pid>/maps)."""
    name = f"kvmesh-dp-{node.node_id}.tier"
    for line in Path(f"/proc/{node.proc.pid}/maps").read_text().splitlines():
        if line.endswith(name):
            return int(line.split("-", 1)[0], 16)
    raise AssertionError(f"{name} is not mapped in {node.node_id}'s process")


def process_bytes(node: DataPlaneProcess, addr: int, nbytes: int) -> bytes:
    """``nbytes`` at ``addr`` in the node's process (read through /proc/<pid>/mem, as root)."""
    with open(f"/proc/{node.proc.pid}/mem", "rb") as mem:
        mem.seek(addr)
        return mem.read(nbytes)


def as_peer(identity: NodeIdentity, node: DataPlaneProcess) -> DataPlaneClient:
    return DataPlaneClient(node.address, peer_proof=lambda g, method: identity.proof(g, method, node.node_id))


async def store(node: DataPlaneProcess, ns: Namespace, n: int = N) -> tuple[list[bytes], list[bytes]]:
    """Commits n blocks of random bytes on ``node`` through its local API; their hashes and contents."""
    hashes, contents = [os.urandom(32) for _ in range(n)], [os.urandom(BLOCK) for _ in range(n)]
    async with DataPlaneClient(node.address, key=node.api_key) as owner:
        tier = SharedTier.open(await owner.describe_tier())
        for slot, data in zip(await owner.reserve(ns, hashes), contents):
            tier.slot(slot)[:] = np.frombuffer(data, dtype=np.uint8)
        tier.close()
        assert await owner.commit(ns, hashes) == n
    return hashes, contents


async def engine_reads(node: DataPlaneProcess, ns: Namespace, hashes: list[bytes]) -> tuple[list[int], list[bytes]]:
    """What the node's engine gets for ``hashes``: Acquire's slots, and the bytes in them."""
    async with DataPlaneClient(node.address, key=node.api_key) as local:
        slots, lease = await local.acquire(ns, hashes)
        tier = SharedTier.open(await local.describe_tier())
        contents = [bytes(tier.slot(s)) for s in slots]
        tier.close()
        if lease:
            await local.release(lease)
    return slots, contents


async def slot_bytes(node: DataPlaneProcess, slot: int) -> bytes:
    """The bytes in one slot of the node's tier, read straight from its shared memory."""
    async with DataPlaneClient(node.address, key=node.api_key) as local:
        tier = SharedTier.open(await local.describe_tier())
        data = bytes(tier.slot(slot))
        tier.close()
    return data


async def dp2_hands_node_b_its_metadata(dp2: DataPlaneProcess, rogue) -> bytes:
    """A tenant-B request on dp2 names node-b as its source: dp2 handshakes with the rogue server."""
    servicer, address = rogue
    async with DataPlaneClient(dp2.address, key=dp2.api_key) as local:
        assert (await local.pull(NS_B, [os.urandom(32)], "node-b", address)).pulled == 0
    return servicer.metadata["dp2"]


async def test_node_b_cannot_have_dp1_write_over_tenant_as_block_on_dp2(world, rogue):
    dp1, dp2 = await world.data_plane("dp1"), await world.data_plane("dp2")
    a_hashes, a_bytes = await store(dp2, NS_A)
    b_hashes, b_bytes = await store(dp1, NS_B)
    slots, seen = await engine_reads(dp2, NS_A, a_hashes)
    assert seen == a_bytes, "control: A's engine on dp2 reads A's committed blocks"
    metadata = await dp2_hands_node_b_its_metadata(dp2, rogue)
    target = tier_address(dp2) + slots[0] * BLOCK  # A's first block on dp2

    me = NodeIdentity()  # the rogue's peer key: the control plane binds node-b's grants to it
    grant = await world.grant("node-b", NS_B, "dp1", me.public_key)
    async with as_peer(me, dp1) as peer:
        answer, _ = await peer.lookup(NS_B, b_hashes[:1], lease_ms=30_000, grant=grant)
        assert answer.lease_id, "control: node-b may pull tenant B's block from dp1"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.exchange_agent_metadata("node-b", metadata, BLOCK, grant=grant)  # dp2's agent as its own
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:  # no endpoint of node-b: nothing to WRITE to
            await peer.send(NS_B, answer.lease_id, b_hashes[:1], [target], grant=grant)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        with nixl_agent_with_buffer("node-b", N * BLOCK) as (agent, buf):
            await handshake(peer, "node-b", agent, grant, BLOCK)
            own = buf.ctypes.data
            for landing in ([target], [own + 64]):  # dp2's memory; not a whole slot of its own
                answer, _ = await peer.lookup(NS_B, b_hashes[:1], lease_ms=30_000, grant=grant)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await peer.send(NS_B, answer.lease_id, b_hashes[:1], landing, grant=grant)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert not buf.any()
            answer, _ = await peer.lookup(NS_B, b_hashes[:1], lease_ms=30_000, grant=grant)
            assert await peer.send(NS_B, answer.lease_id, b_hashes[:1], [own], grant=grant) == (1, BLOCK)
            assert bytes(buf[:BLOCK]) == b_bytes[0], "control: node-b's own slots get B's block"

    assert await slot_bytes(dp2, slots[0]) == a_bytes[0], "dp1 wrote nothing into dp2"
    assert (await engine_reads(dp2, NS_A, a_hashes))[1] == a_bytes, "A's engine on dp2 still reads A's bytes"


async def test_a_handshake_replaces_only_the_callers_own_endpoint(world, rogue):
    dp1, dp2 = await world.data_plane("dp1"), await world.data_plane("dp2")
    first, _ = await store(dp1, NS_A)
    later, _ = await store(dp1, NS_A)
    async with DataPlaneClient(dp2.address, key=dp2.api_key) as local:
        assert (await local.pull(NS_A, first, "dp1", dp1.address)).pulled == N, "control: dp1 WRITEs to dp2"
        metadata = await dp2_hands_node_b_its_metadata(dp2, rogue)
        me = NodeIdentity()
        grant = await world.grant("node-b", NS_B, "dp1", me.public_key)
        with nixl_agent_with_buffer("node-b", BLOCK) as (agent, _):
            async with as_peer(me, dp1) as peer:
                with contextlib.suppress(grpc.aio.AioRpcError):  # refused: see the test above
                    await peer.exchange_agent_metadata("node-b", metadata, BLOCK, grant=grant)
                await handshake(peer, "node-b", agent, grant, BLOCK)  # control: node-b handshakes as itself
        result = await local.pull(NS_A, later, "dp1", dp1.address)
        assert result.pulled == N, "dp2's endpoint at dp1 survived node-b's handshakes"


async def test_a_source_dp2_pulled_from_reaches_only_its_own_landing_arena(world, rogue):
    """node-b is a source dp2 pulled from, so it holds the NIXL metadata dp2 handed it, and runs its own NIXL
    agent, where nothing of dp2 runs. That metadata used to describe dp2's whole tier: node-b READ tenant A's
    blocks there (A does not allow node-b) and WROTE over them. It now describes node-b's landing arena on dp2:
    NIXL refuses A's block both ways, the arena takes node-b's own transfers, and holds nothing of what dp2
    pulled from dp1."""
    dp1, dp2 = await world.data_plane("dp1"), await world.data_plane("dp2")
    from_dp1, dp1_bytes = await store(dp1, NS_A)
    a_hashes, a_bytes = await store(dp2, NS_A)
    async with DataPlaneClient(dp2.address, key=dp2.api_key) as local:
        assert (await local.pull(NS_A, from_dp1, "dp1", dp1.address)).pulled == N, "control: dp1 WRITEs to dp2"
    slots, seen = await engine_reads(dp2, NS_A, a_hashes)
    assert seen == a_bytes, "control: A's engine on dp2 reads A's committed blocks"
    target = tier_address(dp2) + slots[1] * BLOCK
    assert process_bytes(dp2, target, BLOCK) == a_bytes[1], "control: A's block is at that address in dp2"
    metadata = await dp2_hands_node_b_its_metadata(dp2, rogue)
    arena, arena_bytes = read_agent_metadata(metadata).regions[0]

    evil = os.urandom(BLOCK)
    with nixl_agent_with_buffer("node-b", arena_bytes) as (agent, buf):
        remote = agent.add_remote_agent(metadata)
        assert nixl_xfer(agent, "READ", buf, remote, target) == "refused"
        assert not buf.any(), "node-b read nothing of A's block"
        buf[:BLOCK] = np.frombuffer(evil, dtype=np.uint8)
        assert nixl_xfer(agent, "WRITE", buf, remote, target) == "refused"
        assert nixl_xfer(agent, "WRITE", buf, remote, arena) == "DONE", "control: node-b's arena takes its WRITE"
        buf[:] = 0
        assert nixl_xfer(agent, "READ", buf, remote, arena, arena_bytes) == "DONE", "control: and its READ"
        assert bytes(buf[:BLOCK]) == evil, "control: node-b read back what it wrote"
        seen_by_b = bytes(buf)
        agent.remove_remote_agent(remote)
    assert not any(block[:4096] in seen_by_b for block in dp1_bytes + a_bytes), \
        "node-b's arena holds no byte of the blocks dp2 pulled from dp1 or holds"
    assert process_bytes(dp2, target, BLOCK) == a_bytes[1], "A's block on dp2 is unchanged"
    assert (await engine_reads(dp2, NS_A, a_hashes))[1] == a_bytes


async def test_corrupted_copies_of_a_consumers_metadata_never_block_its_real_one(world, rogue):
    """Copies of dp2's metadata, cut or with a tag changed, reach dp1 under dp2's name (a link that flips bits,
    a party holding dp2's grant): dp1 refuses each before NIXL sees it, and dp2's pulls keep working."""
    dp1, dp2 = await world.data_plane("dp1"), await world.data_plane("dp2")
    first, _ = await store(dp1, NS_A)
    later, _ = await store(dp1, NS_A)
    async with DataPlaneClient(dp2.address, key=dp2.api_key) as local:
        assert (await local.pull(NS_A, first, "dp1", dp1.address)).pulled == N, "control: dp2 pulls from dp1"
        metadata = await dp2_hands_node_b_its_metadata(dp2, rogue)
        me = NodeIdentity()
        grant = await world.grant("dp2", NS_A, "dp1", me.public_key)
        tag = metadata.rindex(b"nixlSDList")
        corrupted = [metadata[:-5], metadata[:tag] + b"nixlSDLisT" + metadata[tag + 10:]]
        async with as_peer(me, dp1) as peer:
            for bad in corrupted:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await peer.exchange_agent_metadata("dp2", bad, BLOCK, grant=grant)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await local.pull(NS_A, later, "dp1", dp1.address)).pulled == N, "dp2's endpoint stayed"
        async with as_peer(me, dp1) as peer:  # and its real metadata is still accepted
            assert (await peer.exchange_agent_metadata("dp2", metadata, BLOCK, grant=grant)).node_id == "dp1"


async def test_node_bs_name_around_dp2s_worker_gets_no_write(world, rogue):
    """The same attack with metadata built for it: dp2's worker address and memory under an agent name of
    node-b's, which the name check alone lets through. dp1 loads it and sends that agent a challenge, which
    reaches dp2's process, not node-b: node-b cannot answer, and dp1 never WRITEs to the agent."""
    dp1, dp2 = await world.data_plane("dp1"), await world.data_plane("dp2")
    a_hashes, a_bytes = await store(dp2, NS_A)
    b_hashes, _ = await store(dp1, NS_B)
    slots, seen = await engine_reads(dp2, NS_A, a_hashes)
    assert seen == a_bytes, "control: A's engine on dp2 reads A's committed blocks"
    metadata = await dp2_hands_node_b_its_metadata(dp2, rogue)
    forged = renamed(metadata, f"node-b-{uuid.uuid4().hex[:8]}")
    target = tier_address(dp2) + slots[0] * BLOCK

    me = NodeIdentity()
    grant = await world.grant("node-b", NS_B, "dp1", me.public_key)
    async with as_peer(me, dp1) as peer:
        answer, _ = await peer.lookup(NS_B, b_hashes[:1], lease_ms=30_000, grant=grant)
        await peer.exchange_agent_metadata("node-b", forged, BLOCK, grant=grant)  # passes the name check
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a guess: the challenge went to dp2's process
            await peer.exchange_agent_metadata("node-b", b"", BLOCK, grant=grant, challenge_answer=b"0" * 32)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.send(NS_B, answer.lease_id, b_hashes[:1], [target], grant=grant)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert await slot_bytes(dp2, slots[0]) == a_bytes[0], "dp1 wrote nothing into dp2"
    assert (await engine_reads(dp2, NS_A, a_hashes))[1] == a_bytes


async def test_node_b_cannot_have_dp2_relay_the_challenge_dp1_sent_it(world, rogue):
    """The forged handshake of the test above, then node-b has dp2 answer dp1's challenge for it: a B request on
    dp2 names node-b, whose handshake answer names dp1's agent as node-b's and says a challenge was sent. dp2
    answers only challenges from an agent of the node it dialled, so nothing reaches node-b to relay to dp1."""
    servicer, _ = rogue
    dp1, dp2 = await world.data_plane("dp1"), await world.data_plane("dp2")
    a_hashes, a_bytes = await store(dp2, NS_A)
    b_hashes, _ = await store(dp1, NS_B)
    slots, seen = await engine_reads(dp2, NS_A, a_hashes)
    assert seen == a_bytes, "control: A's engine on dp2 reads A's committed blocks"
    metadata = await dp2_hands_node_b_its_metadata(dp2, rogue)
    assert servicer.metadata["dp2"], "control: dp2 hands node-b its metadata"

    me = NodeIdentity()
    grant = await world.grant("node-b", NS_B, "dp1", me.public_key)
    async with as_peer(me, dp1) as peer:
        answer, _ = await peer.lookup(NS_B, b_hashes[:1], lease_ms=30_000, grant=grant)
        hs = await peer.exchange_agent_metadata("node-b", renamed(metadata, f"node-b-{uuid.uuid4().hex[:8]}"),
                                                BLOCK, grant=grant)  # dp1's challenge goes to dp2's agent
        servicer.claim_agent = hs.agent_name  # node-b now poses as dp1's agent to dp2
        servicer.metadata.clear()
        await dp2_hands_node_b_its_metadata(dp2, rogue)
        relayed = servicer.answers.get("dp2", b"")
        assert not relayed, "dp2 answered a challenge that dp1 sent it, to node-b"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.exchange_agent_metadata("node-b", b"", BLOCK, grant=grant, challenge_answer=b"0" * 32)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.send(NS_B, answer.lease_id, b_hashes[:1], [tier_address(dp2) + slots[0] * BLOCK],
                            grant=grant)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (await engine_reads(dp2, NS_A, a_hashes))[1] == a_bytes
