"""Attack 1 of issue 9: capturing a node's credentials through a source address it is told to dial.

A node's API key is used with the control plane only. Peer calls carry a grant bound to the consumer's peer
key and a proof of possession made for one target node, one method, now; the consumer dials only the address
the control plane registered for the node a request names. Real Redis and control plane (in this process),
real data-plane processes (NIXL), and a malicious listener in this process that records what reaches it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
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
from tenancy.auth import GRANT_METADATA
from tenancy.grants import GrantSigner, RouteToken
from tenancy.peer_proof import PROOF_METADATA, NodeIdentity, PeerCall

from control_plane.config import ControlPlaneConfig
from control_plane.server import serve as serve_control_plane
from data_plane.client import DataPlaneClient, SharedTier
from data_plane.auth import KEY_RECHECK_S
from kvmesh_apps.dp_process import DataPlaneProcess

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

BLOCK = 64 * 1024
NS = Namespace("t-peer", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()


class Recorder(dp_grpc.DataPlaneServicer):
    """An attacker's 'data plane': records the metadata of every call that reaches it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []

    async def ExchangeAgentMetadata(self, request, context):
        self.calls.append({k: v for k, v in context.invocation_metadata()})
        await context.abort(grpc.StatusCode.UNAVAILABLE, "recorded")


class World:
    def __init__(self, cp, admin_key: str, shm_dir: Path) -> None:
        self.cp, self.admin_key, self.shm_dir = cp, admin_key, shm_dir
        self.address = f"127.0.0.1:{cp.port}"
        self.procs: list[DataPlaneProcess] = []

    async def node_key(self, node_id: str) -> str:
        async with channel(self.address, self.admin_key) as ch:
            reply = await tpb_grpc.TenantAdminStub(ch).IssueKey(tpb.IssueKeyRequest(role=tpb.ROLE_NODE,
                                                                                     node_id=node_id))
        return reply.secret

    async def data_plane(self, node_id: str, **env: str) -> DataPlaneProcess:
        proc = await asyncio.to_thread(DataPlaneProcess, node_id, dict(
            listen="127.0.0.1:0", shm_dir=self.shm_dir, block_bytes=BLOCK, capacity_bytes=32 * BLOCK,
            api_key=await self.node_key(node_id), control_plane_address=self.address), env)
        self.procs.append(proc)
        for _ in range(100):  # registration is asynchronous
            if any(n.node.node_id == node_id and n.live for n in await self.cp.core.block_map.list_nodes()):
                return proc
            await asyncio.sleep(0.05)
        raise AssertionError(f"{node_id} never registered")

    async def grant(self, consumer_key: str, source: str, public_key: bytes) -> bytes:
        async with channel(self.address, consumer_key) as ch:
            reply = await cp_grpc.ControlPlaneStub(ch).IssuePullGrant(cp_pb.IssuePullGrantRequest(
                namespace=NS.to_proto(), source_node_id=source, consumer_public_key=public_key))
        return reply.token


@pytest.fixture
async def world(redis_server, key_prefix, admin_key):
    cp = await serve_control_plane(ControlPlaneConfig(listen="127.0.0.1:0", redis_url=redis_server.url,
                                                      key_prefix=key_prefix, admin_key=admin_key, policy_ttl_s=0))
    shm_dir = Path("/dev/shm") / f"kvmesh-sec-{uuid.uuid4().hex[:10]}"
    shm_dir.mkdir()
    w = World(cp, admin_key, shm_dir)
    async with channel(w.address, admin_key) as ch:
        await tpb_grpc.TenantAdminStub(ch).CreateTenant(tpb.CreateTenantRequest(tenant_id=NS.tenant))
    yield w
    for proc in w.procs:  # in a thread: a stopping data plane deregisters with the control plane on this loop
        if proc.proc.poll() is None:
            await asyncio.to_thread(proc.stop)
    await cp.stop()
    shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.fixture
async def recorder():
    servicer = Recorder()
    server = await start_server("127.0.0.1:0", [ServiceBinding(servicer, dp_grpc.add_DataPlaneServicer_to_server,
                                                               "kvmesh.v1.DataPlane")])
    yield servicer, f"127.0.0.1:{server.port}"
    await server.stop()


async def store(node: DataPlaneProcess, n: int) -> list[bytes]:
    hashes = [os.urandom(32) for _ in range(n)]
    async with DataPlaneClient(node.address, key=node.api_key) as owner:
        tier = SharedTier.open(await owner.describe_tier())
        for slot in await owner.reserve(NS, hashes):
            tier.slot(slot)[:] = np.frombuffer(os.urandom(BLOCK), dtype=np.uint8)
        tier.close()
        await owner.commit(NS, hashes)
    return hashes


async def test_an_unregistered_source_address_is_never_dialed(world, recorder):
    calls, evil_address = recorder
    source, consumer = await world.data_plane("dp-src"), await world.data_plane("consumer")
    hashes = await store(source, 4)
    async with DataPlaneClient(consumer.address, key=consumer.api_key) as local:
        # remote_kv_source names dp-src at the attacker's address: refused before any dial
        refused = await local.pull(NS, hashes, "dp-src", evil_address)
        assert refused.pulled == 0 and calls.calls == []
        assert "not the registered address of node dp-src" in refused.refused  # the reason, for the request
        # positive control: the registered address is dialed and the blocks arrive
        assert (await local.pull(NS, hashes, "dp-src", source.address)).pulled == 4


async def test_a_registered_malicious_peer_captures_nothing_reusable(world, recorder):
    """'evil' is a real, registered node (it holds a node key) that records what a consumer sends it."""
    calls, evil_address = recorder
    source, consumer = await world.data_plane("dp-src"), await world.data_plane("consumer")
    async with channel(world.address, await world.node_key("evil")) as ch:
        await cp_grpc.ControlPlaneStub(ch).RegisterNode(cp_pb.RegisterNodeRequest(
            node=cp_pb.NodeInfo(node_id="evil", data_plane_address=evil_address)))
    hashes = await store(source, 2)
    async with DataPlaneClient(consumer.address, key=consumer.api_key) as local:
        assert (await local.pull(NS, hashes, "evil", evil_address)).pulled == 0
    assert len(calls.calls) == 1, "positive control: the consumer did call the registered node"
    captured = calls.calls[0]
    assert "authorization" not in captured, "no API key goes to a peer"
    assert consumer.api_key not in " ".join(captured.values())
    assert captured[GRANT_METADATA] and captured[PROOF_METADATA]
    # Replayed at the real source, the captured grant and proof open nothing.
    async with grpc.aio.insecure_channel(source.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await dp_grpc.DataPlaneStub(ch).ExchangeAgentMetadata(
                dp_pb.ExchangeAgentMetadataRequest(node_id="consumer", block_bytes=BLOCK),
                metadata=tuple(captured.items()))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_proof_is_good_once_for_one_node_one_call_now(world, monkeypatch):
    source = await world.data_plane("dp-src")
    me = NodeIdentity()  # this process plays the consumer node's data plane (it holds the node's key)
    grant = await world.grant(await world.node_key("consumer"), "dp-src", me.public_key)
    request = dp_pb.LookupRequest(namespace=NS.to_proto(), block_hashes=[os.urandom(32)])

    async def lookup(proof: str, method=None) -> str:
        async with grpc.aio.insecure_channel(source.address) as ch:
            stub = dp_grpc.DataPlaneStub(ch)
            call = stub.Release(dp_pb.ReleaseRequest(lease_id="x"), metadata=md(proof)) if method == "Release" \
                else stub.Lookup(request, metadata=md(proof))
            try:
                await call
                return "ok"
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc.details()
                return exc.details()

    def md(proof: str):
        return ((GRANT_METADATA, grant.decode()), (PROOF_METADATA, proof))

    call = PeerCall.of("Lookup", request)
    proof = me.proof(grant, call, "dp-src")
    assert await lookup(proof) == "ok"  # positive control
    assert "replayed" in await lookup(proof)
    assert "does not verify" in await lookup(me.proof(grant, call, "another-node"))
    assert "does not verify" in await lookup(me.proof(grant, PeerCall("Release", call.request_digest), "dp-src"),
                                             method="Release")
    other_hashes = PeerCall.of("Lookup", dp_pb.LookupRequest(namespace=NS.to_proto(), block_hashes=[bytes(32)]))
    assert "does not verify" in await lookup(me.proof(grant, other_hashes, "dp-src"))  # made for other arguments
    assert "does not verify" in await lookup(NodeIdentity().proof(grant, call, "dp-src"))  # not the bound key
    real_time = time.time
    monkeypatch.setattr("tenancy.peer_proof.time.time", lambda: real_time() - 120)
    stale = me.proof(grant, call, "dp-src")
    monkeypatch.undo()
    assert "time window" in await lookup(stale)
    assert await lookup(me.proof(grant, call, "dp-src")) == "ok"  # a fresh one still works


async def test_with_require_route_token_only_sources_route_signed_are_pulled(world):
    source = await world.data_plane("dp-src")
    consumer = await world.data_plane("consumer", KVMESH_DP_REQUIRE_ROUTE_TOKEN="true")
    hashes = await store(source, 3)

    def route_token(node_id: str, address: str, signer=world.cp.core.signer, tenant=NS.tenant) -> str:
        """As Route signs it."""
        return signer.sign(RouteToken(tenant, node_id, address, int(time.time() * 1000) + 30_000)).decode()

    async with DataPlaneClient(consumer.address, key=consumer.api_key) as local:
        refusals = {
            "carries no route_token": "",
            "names dp-src at 127.0.0.1:1": route_token("dp-src", "127.0.0.1:1"),
            "unknown key": route_token("dp-src", source.address, signer=GrantSigner.generate()),
            # Route named this source for another tenant's request: it says nothing about this tenant's
            "is for tenant 'another-tenant'": route_token("dp-src", source.address, tenant="another-tenant"),
        }
        for reason, token in refusals.items():
            result = await local.pull(NS, hashes, "dp-src", source.address, route_token=token)
            assert result.pulled == 0 and reason in result.refused, result.refused
        ok = await local.pull(NS, hashes, "dp-src", source.address, route_token=route_token("dp-src", source.address))
        assert ok.pulled == 3 and not ok.refused  # positive control


async def locked_out(local: DataPlaneClient, hashes: list[bytes], within_s: float = 20.0) -> bool:
    """Whether the node's local API refuses its own key within ``within_s`` (it learns of the control plane's
    refusal on its next control-plane call: a reservation's limits)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            await local.reserve(NS, [os.urandom(32)])
            await local.lookup(NS, hashes)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc.details()
            assert "refuses this node's key" in exc.details()
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)


async def test_a_revoked_node_key_no_longer_opens_its_own_data_planes_local_api(world):
    """Found in review: a data plane checked its own key against its configured hash only, and took the control
    plane's refusal of that key for an outage (last known limits, fail open): a leaked node key, revoked, still
    opened the node's local API (every tenant's blocks there looked up, pinned, slots reserved). Now the control
    plane's UNAUTHENTICATED to the node's key closes the local API to it. Control: the key works before the
    revocation."""
    from tenancy import api_keys
    proc = await world.data_plane("dp-rev", KVMESH_DP_CONTROL_PLANE_REFRESH_MS="300")
    hashes = await store(proc, 2)
    async with DataPlaneClient(proc.address, key=proc.api_key) as local:
        assert [s.name for s in (await local.lookup(NS, hashes))[0].statuses] == ["HIT", "HIT"]  # control: not revoked
        async with channel(world.address, world.admin_key) as ch:
            await tpb_grpc.TenantAdminStub(ch).RevokeKey(tpb.RevokeKeyRequest(key_id=api_keys.parse(proc.api_key)[0]))
        assert await locked_out(local, hashes), "the revoked node key still opens the local API"
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await local.lookup(NS, hashes)
        assert again.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await asyncio.sleep(KEY_RECHECK_S + 1)  # the background recheck finds the key still refused
        with pytest.raises(grpc.aio.AioRpcError) as still:
            await local.lookup(NS, hashes)
        assert still.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_node_key_the_control_plane_takes_again_reopens_the_local_api(world, redis_server, key_prefix):
    """The lock's other side: a control plane that refused the node's key for a reason that passes (here its Redis
    lost the key's record, then got it back, as from a backup) takes it again, and the node's local API reopens
    within KEY_RECHECK_S (the data plane puts its key to the control plane in the background), with nothing
    restarted. Control: closed while the record is gone."""
    import redis.asyncio as aioredis
    from tenancy import api_keys
    from tenancy.keys import TenantKeys
    proc = await world.data_plane("dp-back", KVMESH_DP_CONTROL_PLANE_REFRESH_MS="300")
    hashes = await store(proc, 2)
    record = TenantKeys(key_prefix).api_key(api_keys.parse(proc.api_key)[0])
    redis = aioredis.from_url(redis_server.url)
    try:
        dumped = await redis.dump(record)
        assert dumped is not None, record
        async with DataPlaneClient(proc.address, key=proc.api_key) as local:
            await redis.delete(record)
            assert await locked_out(local, hashes), "a key the control plane refuses still opens the local API"
            await redis.restore(record, 0, dumped)
            deadline = time.monotonic() + KEY_RECHECK_S + 5.0
            while True:
                try:
                    statuses = (await local.lookup(NS, hashes))[0].statuses
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc.details()
                    assert time.monotonic() < deadline, "the key the control plane takes again stays locked out"
                    await asyncio.sleep(0.2)
            assert [s.name for s in statuses] == ["HIT", "HIT"]
    finally:
        await redis.aclose()
