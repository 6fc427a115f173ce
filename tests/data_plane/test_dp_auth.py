"""Every data-plane RPC is authenticated: the local API takes the node's own key, the peer API a grant
signed for the caller's key, this source and the namespace. Forged, expired, other-node grants fail."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from kvmesh.namespace import Namespace
from tenancy import api_keys
from tenancy.grants import Grant, GrantSigner
from tenancy.peer_proof import NodeIdentity, encode_public_key

from data_plane.client import DataPlaneClient
from data_plane.types import BlockKey, LookupStatus
from kvmesh_apps.fleet_tls import FleetTLS, engine_name


@pytest.fixture
async def source(local_node):
    return await local_node(node_id="src")


async def expect(coro, code, text):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    assert err.value.code() == code, err.value.details()
    assert text in err.value.details()


async def test_local_api_needs_the_nodes_own_key(source, ns):
    async with DataPlaneClient(source.address) as anonymous:
        await expect(anonymous.describe_tier(), grpc.StatusCode.UNAUTHENTICATED, "missing credentials")
    async with DataPlaneClient(source.address, key="not-a-key") as garbled:
        await expect(garbled.ping(), grpc.StatusCode.UNAUTHENTICATED, "malformed API key")
    async with DataPlaneClient(source.address, key=api_keys.new_key()[1]) as other_node:
        await expect(other_node.reserve(ns, [os.urandom(32)]), grpc.StatusCode.PERMISSION_DENIED,
                     "local API: present the node's own key")
        await expect(other_node.pull(ns, [os.urandom(32)], "x", "127.0.0.1:1"), grpc.StatusCode.PERMISSION_DENIED,
                     "local API")
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner:
        await owner.ping()


async def test_peer_lookups_need_a_valid_grant(source, ns, grant):
    me, thief = NodeIdentity(), NodeIdentity()  # this process plays a peer node (and a thief)
    hashes = [os.urandom(32)]
    good = grant(me.public_key, "peer", "src", ns)
    other_ns = Namespace("tenant-b", ns.model, ns.weight_version, ns.cache_config)
    cases = {
        "invalid pull grant": good[:-4] + b"AAAA",
        "pull grant expired": grant(me.public_key, "peer", "src", ns, ttl_ms=-1),
        "pull grant is for another source node": grant(me.public_key, "peer", "elsewhere", ns),
        "pull grant is for another namespace": grant(me.public_key, "peer", "src", other_ns),
        "peer proof does not verify": grant(thief.public_key, "thief", "src", ns),  # another node's grant
    }
    forged = Grant(ns.tenant, ns.fingerprint, "peer", encode_public_key(me.public_key), "src", 2**62)
    cases["signed by an unknown key"] = GrantSigner.generate().sign(forged)  # by anyone but the control plane
    async with DataPlaneClient(source.address, peer_proof=lambda g, m: me.proof(g, m, "src")) as peer:
        for reason, token in cases.items():
            await expect(peer.lookup(ns, hashes, grant=token), grpc.StatusCode.PERMISSION_DENIED, reason.strip())
        await expect(peer.exchange_agent_metadata("peer", b"", source.core.block_bytes),
                     grpc.StatusCode.UNAUTHENTICATED, "missing credentials")  # no grant, no proof, no key
    async with DataPlaneClient(source.address, key=api_keys.new_key()[1]) as keyed:  # an API key proves nothing
        await expect(keyed.lookup(ns, hashes, grant=good), grpc.StatusCode.PERMISSION_DENIED, "proof of possession")
        await expect(keyed.lookup(ns, hashes), grpc.StatusCode.PERMISSION_DENIED, "needs a pull grant")
    async with DataPlaneClient(source.address, peer_proof=lambda g, m: me.proof(g, m, "src")) as peer:
        answer, _ = await peer.lookup(ns, hashes, grant=good)  # the real thing is served
        assert answer.statuses == [LookupStatus.MISS]


async def test_a_peer_cannot_release_another_tenants_lease(source, ns, grant):
    """Tenant A's puller holds a lease on A's block; tenant B's puller, with a valid grant of its own and A's
    lease id, cannot release it (the block stays pinned); A's own Release does."""
    block = os.urandom(32)
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner:
        slots = await owner.reserve(ns, [block])
        await owner.commit(ns, [block])
    a_id, b_id = NodeIdentity(), NodeIdentity()  # two peer nodes' keys
    other_ns = Namespace("tenant-b", ns.model, ns.weight_version, ns.cache_config)
    async with DataPlaneClient(source.address, peer_proof=lambda g, m: a_id.proof(g, m, "src")) as a, \
            DataPlaneClient(source.address, peer_proof=lambda g, m: b_id.proof(g, m, "src")) as b:
        a_key, b_key = a_id.public_key, b_id.public_key
        answer, _ = await a.lookup(ns, [block], lease_ms=60_000, grant=grant(a_key, "node-a", "src", ns))
        assert answer.statuses == [LookupStatus.HIT] and answer.lease_id  # positive control: A holds a lease
        pinned = source.core.tier.get(BlockKey(ns.fingerprint, block))
        assert pinned is not None and pinned.pins == 1
        await b.release(answer.lease_id, grant=grant(b_key, "node-b", "src", other_ns))
        assert pinned.pins == 1  # B's release of A's lease did nothing
        await a.release(answer.lease_id, grant=grant(a_key, "node-a", "src", ns))
        assert pinned.pins == 0
    assert slots


async def test_an_oversized_request_is_refused_by_count_before_its_credentials_are_checked(source, ns, grant):
    """Found by the black-box judge: a peer's request was read whole (and digested for its proof) before anything
    was checked, so anyone reaching the port (no key; a made-up grant and proof pass the interceptor to the
    handler) could make the node convert and hash a 64 MiB request. Now its hashes are counted first."""
    me = NodeIdentity()
    limit = source.core.config.max_hashes_per_request
    good = grant(me.public_key, "peer", "src", ns)
    async with DataPlaneClient(source.address, peer_proof=lambda g, m: me.proof(g, m, "src")) as peer:
        answer, _ = await peer.lookup(ns, [os.urandom(32) for _ in range(limit)], grant=good)  # positive control
        assert len(answer.statuses) == limit
        await expect(peer.lookup(ns, [os.urandom(32) for _ in range(limit + 1)], grant=b"x.y"),
                     grpc.StatusCode.INVALID_ARGUMENT, f"{limit + 1} block hashes in one request; the limit is {limit}")


async def hold_to_the_limit(peer: DataPlaneClient, ns, pending: bytes, token: bytes):
    """Lookups of ``peer`` waiting on the reserved block ``pending``, one more each round, until the node refuses
    the next call; returns the waiting calls and that refusal (None: never refused)."""
    def hold() -> asyncio.Task:
        return asyncio.create_task(peer.lookup(ns, [pending], pending_wait_ms=30_000, grant=token, timeout=60))

    held: list[asyncio.Task] = []
    for _ in range(200):  # until the server has all of them in flight (a call then is refused)
        for i, task in enumerate(held):  # a probe that arrived before it took its place: it is asked again
            error = task.exception() if task.done() else None
            if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                held[i] = hold()
        try:
            answer, _ = await peer.lookup(ns, [os.urandom(32)], grant=token)
            assert answer.statuses == [LookupStatus.MISS]
        except grpc.aio.AioRpcError as exc:
            return held, exc
        held.append(hold())
        await asyncio.sleep(0.02)
    return held, None


async def test_a_peer_keeps_no_more_calls_in_flight_here_than_the_limit(local_node, ns, grant):
    """A peer holding a valid grant keeps Lookups waiting on a pending block (each up to the longest wait it may
    ask for). Past ``max_calls_in_flight_per_key`` the next call from its host is refused at once, while the
    node's own engines are served; once the waits end, the peer is served again."""
    limit = 4
    node = await local_node(node_id="src", max_calls_in_flight_per_key=limit, max_pending_wait_ms=30_000)
    pending, other = os.urandom(32), os.urandom(32)
    me = NodeIdentity()
    token = grant(me.public_key, "peer", "src", ns)
    async with DataPlaneClient(node.address, key=node.core.config.node_key()) as owner, \
            DataPlaneClient(node.address, peer_proof=lambda g, m: me.proof(g, m, "src")) as peer:
        await owner.reserve(ns, [pending])  # reserved, not committed: a peer's Lookup waits for it
        held, refused = await hold_to_the_limit(peer, ns, pending, token)
        assert refused is not None, ("the peer's calls past the limit were served; the held calls: "
                                     f"{[repr(t.exception()) if t.done() else 'in flight' for t in held]}")
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_calls_in_flight_per_key" in refused.details() and "\n" not in refused.details()
        assert not any(task.done() for task in held)  # the limit refused the newcomer, not the calls in flight
        # Positive controls: the node's own key is served meanwhile, and its commit ends the peer's waits.
        assert (await owner.describe_tier()).block_bytes == node.core.block_bytes
        await owner.commit(ns, [pending])
        for task in held:
            answer, _ = await asyncio.wait_for(task, 10)
            assert answer.statuses == [LookupStatus.HIT]
        answer, _ = await peer.lookup(ns, [other], grant=token)
        assert answer.statuses == [LookupStatus.MISS]


async def test_peers_on_one_host_are_bounded_apart_by_their_certificates(local_node, ns, grant, tmp_path):
    """Over mutual TLS a peer's calls count against its certificate, not its host: on one host (``kvmesh up``'s
    fleet, or peers behind one NAT address), p1 holding its ``max_calls_in_flight_per_key`` Lookups leaves p2, with
    its own certificate, served. Before, both counted against 127.0.0.1 and p2 was refused: one node's key and
    certificate kept every other peer on its host from pulling. Control: p1's own next call is refused."""
    limit = 4
    tls = FleetTLS.ensure(tmp_path / "tls", ["src", "p1", "p2"])
    node = await local_node(node_id="src", max_calls_in_flight_per_key=limit, max_pending_wait_ms=30_000,
                            tls_cert_file=tls.cert_file("src"), tls_key_file=tls.key_file("src"),
                            tls_client_ca_file=str(tls.ca_file))
    pending = os.urandom(32)
    p1, p2 = NodeIdentity(), NodeIdentity()
    owner = DataPlaneClient(node.address, key=node.core.config.node_key(), tls=tls.client(engine_name("src")))
    first = DataPlaneClient(node.address, tls=tls.client("p1", "src"), peer_proof=lambda g, m: p1.proof(g, m, "src"))
    second = DataPlaneClient(node.address, tls=tls.client("p2", "src"), peer_proof=lambda g, m: p2.proof(g, m, "src"))
    async with owner, first, second:
        await owner.reserve(ns, [pending])
        held, refused = await hold_to_the_limit(first, ns, pending, grant(p1.public_key, "p1", "src", ns))
        assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # control: p1 is full
        answer, _ = await second.lookup(ns, [os.urandom(32)], grant=grant(p2.public_key, "p2", "src", ns))
        assert answer.statuses == [LookupStatus.MISS], "p2 was refused for p1's calls"
        await owner.commit(ns, [pending])
        for task in held:
            answer, _ = await asyncio.wait_for(task, 10)
            assert answer.statuses == [LookupStatus.HIT]

