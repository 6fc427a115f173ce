"""The peer send's own rules (issue 19), played by a granted peer against a real data plane.

The send (a Lookup with ``lease_id`` and ``landing_addrs``) WRITEs the blocks pinned under the caller's lease into
its landing addresses. A granted peer that breaks its rules gets a clear status and no byte: landing addresses
that do not pair one to one with the hashes (INVALID_ARGUMENT), hashes that are not the lease's leading blocks
(INVALID_ARGUMENT), blocks that a new tenant epoch purged between the Lookup and the send (MISS: not written),
and a send that reaches a node that is stopping (MISS: a draining node starts no WRITE). Positive control in
each case: the same peer's well-formed send of a fresh lease writes the source's bytes into its buffer.

The source is a real data plane served in this process (gRPC on loopback, NIXL over UCX tcp); the peer is a NIXL
agent of this process with a registered buffer, calling as a peer (grant and proof, no API key). The source's
own hooks stand in for what the control plane and a SIGTERM do (its ``learn_epoch``, its ``sends.drain``).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from pathlib import Path

import grpc
import pytest

from tenancy import api_keys
from tenancy.grants import Grant, GrantSigner
from tenancy.peer_proof import NodeIdentity, encode_public_key

from data_plane.config import DataPlaneConfig
from data_plane.server import serve
from data_plane.types import LookupStatus

from tests.agent_challenge import handshake
from tests.security.test_byte_path_gating import BLOCK, TENANT_A, as_peer, nixl_agent_with_buffer, store

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

N = 4


class Source:
    def __init__(self, node, signer: GrantSigner) -> None:
        self.node, self.signer = node, signer
        self.node_id, self.address = node.core.node_id, node.address
        self.api_key = node.core.config.node_key()  # what store() uses to commit blocks

    def grant(self, me: NodeIdentity, consumer: str) -> bytes:
        return self.signer.sign(Grant(TENANT_A.tenant, TENANT_A.fingerprint, consumer, encode_public_key(me.public_key),
                                      self.node_id, int(time.time() * 1000) + 60_000))


@pytest.fixture
async def source():
    shm_dir = Path("/dev/shm") / f"kvmesh-send-{uuid.uuid4().hex[:10]}"
    shm_dir.mkdir()
    signer = GrantSigner.generate()
    node = await serve(DataPlaneConfig(
        node_id="src", listen="127.0.0.1:0", shm_dir=shm_dir, block_bytes=BLOCK, capacity_bytes=32 * BLOCK,
        lock_memory=False, lease_sweep_ms=50, api_key=api_keys.new_key()[1],
        grant_public_key=base64.b64encode(signer.public_key).decode()))
    await node.core.transport.ready(60.0)
    yield Source(node, signer)
    await node.stop()
    for leftover in shm_dir.glob("*"):
        leftover.unlink()
    shm_dir.rmdir()


@pytest.fixture
async def peer(source):
    """A granted, handshaken peer of the source: (client, grant, its buffer)."""
    me = NodeIdentity()
    grant = source.grant(me, "peer")
    with nixl_agent_with_buffer("peer", N * BLOCK) as (agent, buf):
        async with as_peer(me, source) as client:
            await handshake(client, "peer", agent, grant, BLOCK)
            yield client, grant, buf


def landing(buf, n: int = N) -> list[int]:
    return [buf.ctypes.data + i * BLOCK for i in range(n)]


def received(buf, n: int = N) -> list[bytes]:
    return [bytes(buf[i * BLOCK:(i + 1) * BLOCK]) for i in range(n)]


async def looked_up(client, grant, hashes) -> str:
    answer, _ = await client.lookup(TENANT_A, hashes, lease_ms=60_000, grant=grant)
    assert answer.statuses == [LookupStatus.HIT] * len(hashes) and answer.lease_id
    return answer.lease_id


async def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details()


async def send_control(source, client, grant, buf) -> None:
    """Positive control: a well-formed send of a fresh lease writes the source's bytes."""
    buf[:] = 0
    hashes, secrets = await store(source, TENANT_A)
    lease = await looked_up(client, grant, hashes)
    assert await client.send(TENANT_A, lease, hashes, landing(buf), grant=grant) == (N, BLOCK)
    assert received(buf) == secrets


async def test_landing_addresses_that_do_not_pair_with_the_hashes_are_invalid_argument(source, peer):
    client, grant, buf = peer
    hashes, _ = await store(source, TENANT_A)
    lease = await looked_up(client, grant, hashes)
    for addrs in (landing(buf, N - 1), landing(buf, N) + [buf.ctypes.data], []):
        code, details = await refused(client.send(TENANT_A, lease, hashes, addrs, grant=grant))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "landing" in details, details
    await asyncio.sleep(0.1)
    assert not buf.any(), "nothing was written"
    await send_control(source, client, grant, buf)


async def test_hashes_that_are_not_the_leases_leading_blocks_are_invalid_argument(source, peer):
    client, grant, buf = peer
    hashes, _ = await store(source, TENANT_A)
    other, _ = await store(source, TENANT_A)
    for sent in (hashes[::-1], hashes[1:], other, hashes[:2] + other[:2]):  # reordered, shifted, foreign, mixed
        lease = await looked_up(client, grant, hashes)
        code, details = await refused(client.send(TENANT_A, lease, sent, landing(buf, len(sent)), grant=grant))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "leading blocks" in details, details
    await asyncio.sleep(0.1)
    assert not buf.any(), "nothing was written"
    await send_control(source, client, grant, buf)


async def test_blocks_purged_by_a_new_tenant_epoch_after_the_lookup_are_not_sent(source, peer):
    """The Lookup pins A's blocks under the lease; then the source learns that A was re-created (the control
    plane's answer: a new epoch), which purges them. The send writes none of them (a MISS for each)."""
    client, grant, buf = peer
    await send_control(source, client, grant, buf)  # before: the same send writes
    buf[:] = 0
    hashes, _ = await store(source, TENANT_A)
    lease = await looked_up(client, grant, hashes)
    source.node.core.learn_epoch(TENANT_A.tenant, "re-created")
    assert await client.send(TENANT_A, lease, hashes, landing(buf), grant=grant) == (0, BLOCK)
    await asyncio.sleep(0.1)
    assert not buf.any(), "no block of the purged epoch was written"


async def test_a_draining_node_starts_no_new_write(source, peer):
    """Once the node is stopping (its stop() drains the WRITEs in flight before giving up its port), a send
    that arrives writes nothing: a MISS, the lease ended."""
    client, grant, buf = peer
    await send_control(source, client, grant, buf)  # before: the same send writes
    buf[:] = 0
    hashes, _ = await store(source, TENANT_A)
    lease = await looked_up(client, grant, hashes)
    await source.node.core.sends.drain(0.0)
    assert await client.send(TENANT_A, lease, hashes, landing(buf), grant=grant) == (0, BLOCK)
    await asyncio.sleep(0.1)
    assert not buf.any(), "a draining node wrote"
    assert all(b.pins == 0 for b in source.node.core.tier.committed()), "the lease was ended: nothing stays pinned"
