"""Attack 3 of issue 9: the grant-signing key. It lives in an operator's file (never in Redis), grants name the key
that signed them, data planes accept only the control plane's current keys (refreshed), and a rotation's overlap
ends: after it, grants under the old key are refused.

Real Redis, a real control plane and a real data plane (gRPC, NIXL) in this process.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid

import grpc
import pytest
import redis.asyncio as aioredis

from kvmesh.channels import channel
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from kvmesh.v1 import tenant_admin_pb2 as tpb, tenant_admin_pb2_grpc as tpb_grpc
from tenancy.grants import Grant, GrantSigner, key_id
from tenancy.peer_proof import NodeIdentity, encode_public_key
from tenancy.keys import TenantKeys

from control_plane.config import ControlPlaneConfig
from control_plane.server import serve as serve_control_plane
from data_plane.client import DataPlaneClient
from data_plane.config import DataPlaneConfig
from data_plane.server import serve as serve_data_plane

os.environ.setdefault("UCX_NET_DEVICES", "lo")
NS = Namespace("t-sign", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
REFRESH_S = 0.3
BOUND_S = 5.0 + 2 * REFRESH_S + 2.0  # GRANT_KEYS_MIN_REFRESH_S, two refresh periods, slack for a loaded host


async def eventually(call, expected: str, bound_s: float) -> bool:
    """Whether ``call()`` answers something containing ``expected`` within ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while True:
        if expected in await call():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(REFRESH_S / 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Setup:
    def __init__(self, redis_url: str, key_prefix: str, admin_key: str, tmp_path) -> None:
        self.redis_url, self.key_prefix, self.admin_key, self.tmp = redis_url, key_prefix, admin_key, tmp_path
        self.address = f"127.0.0.1:{free_port()}"
        self.cp = None

    async def start_cp(self, key_file, previous=()):
        if self.cp is not None:
            await self.cp.stop()
        self.cp = await serve_control_plane(ControlPlaneConfig(
            listen=self.address, redis_url=self.redis_url, key_prefix=self.key_prefix, admin_key=self.admin_key,
            policy_ttl_s=0, grant_key_file=str(key_file), grant_previous_key_files=",".join(map(str, previous))))

    async def node_key(self, node_id: str) -> str:
        async with channel(self.address, self.admin_key) as ch:
            reply = await tpb_grpc.TenantAdminStub(ch).IssueKey(tpb.IssueKeyRequest(role=tpb.ROLE_NODE,
                                                                                     node_id=node_id))
        return reply.secret

    async def grant(self, consumer_key: str) -> bytes:
        async with channel(self.address, consumer_key) as ch:
            reply = await cp_grpc.ControlPlaneStub(ch).IssuePullGrant(cp_pb.IssuePullGrantRequest(
                namespace=NS.to_proto(), source_node_id="src", consumer_public_key=CONSUMER.public_key))
        return reply.token


CONSUMER = NodeIdentity()  # this process plays the consumer node's data plane


async def lookup(source_address: str, consumer_key: str, grant: bytes) -> str:
    """'ok', or the source's refusal (a peer call: no API key, a proof)."""
    async with DataPlaneClient(source_address, peer_proof=lambda g, m: CONSUMER.proof(g, m, "src")) as peer:
        try:
            await peer.lookup(NS, [os.urandom(32)], grant=grant)
            return "ok"
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc.details()
            return exc.details()


@pytest.fixture
async def setup(redis_server, key_prefix, admin_key, tmp_path):
    s = Setup(redis_server.url, key_prefix, admin_key, tmp_path)
    yield s
    if s.cp is not None:
        await s.cp.stop()


async def test_rotation_overlap_accepted_then_the_old_key_refused(setup, tmp_path):
    key_a = tmp_path / "grant-a.pem"
    key_b = tmp_path / "grant-b.pem"
    signer_a, signer_b = GrantSigner.create_file(key_a), GrantSigner.create_file(key_b)
    await setup.start_cp(key_a)
    async with channel(setup.address, setup.admin_key) as ch:
        await tpb_grpc.TenantAdminStub(ch).CreateTenant(tpb.CreateTenantRequest(tenant_id=NS.tenant))
    consumer_key = await setup.node_key("consumer")
    source = await serve_data_plane(DataPlaneConfig(
        node_id="src", listen="127.0.0.1:0", shm_dir=tmp_path, block_bytes=64 << 10, capacity_bytes=1 << 20,
        lock_memory=False, api_key=await setup.node_key("src"), control_plane_address=setup.address,
        grant_keys_refresh_s=REFRESH_S))
    try:
        address = source.address
        grant_a = await setup.grant(consumer_key)
        assert await lookup(address, consumer_key, grant_a) == "ok"  # positive control

        # Forgeries: a grant for the same consumer signed by a key the control plane never had, and one that
        # names key A's id but is signed by another key.
        claims = Grant(NS.tenant, NS.fingerprint, "consumer", encode_public_key(CONSUMER.public_key), "src",
                       int(time.time() * 1000) + 60_000)
        assert "unknown key" in await lookup(address, consumer_key, GrantSigner.generate().sign(claims))
        forged = GrantSigner.generate().sign(claims).decode().split(".")
        genuine = grant_a.decode().split(".")
        assert "invalid pull grant" in await lookup(address, consumer_key,
                                                    f"{genuine[0]}.{forged[1]}".encode())

        # Rotation: B signs, A is still accepted during the overlap.
        await setup.start_cp(key_b, previous=[key_a])
        grant_b = await setup.grant(consumer_key)
        assert grant_key_id(grant_b) == key_id(signer_b.public_key)
        # the source learns B by its periodic refresh, or at once on an unknown key id (at most every 5 s)
        assert await eventually(lambda: lookup(address, consumer_key, grant_b), "ok", BOUND_S)
        assert await lookup(address, consumer_key, grant_a) == "ok"

        # The overlap ends: within a refresh period (plus the one call served while revalidating), A's
        # grants are refused, B's still pass.
        await setup.start_cp(key_b)
        assert await eventually(lambda: lookup(address, consumer_key, grant_a), "unknown key", BOUND_S)
        assert await lookup(address, consumer_key, grant_b) == "ok"
        assert signer_a.key_id != signer_b.key_id
    finally:
        await source.stop()


def grant_key_id(token: bytes) -> str:
    import base64
    import json

    payload = token.decode().split(".")[0]
    grant = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert grant["issued_unix_ms"] <= time.time() * 1000
    return grant["key_id"]


async def redis_values(url: str) -> list[bytes]:
    """Every key name and every value of every key in the Redis database (strings, hashes, sets, streams...)."""
    r = aioredis.from_url(url)
    found: list[bytes] = []
    async for name in r.scan_iter(count=1000):
        found.append(name)
        kind = (await r.type(name)).decode()
        if kind == "string":
            found.append(await r.get(name))
        elif kind == "hash":
            found += [x for kv in (await r.hgetall(name)).items() for x in kv]
        elif kind == "set":
            found += list(await r.smembers(name))
        elif kind == "zset":
            found += [m for m, _ in await r.zrange(name, 0, -1, withscores=True)]
        elif kind == "list":
            found += await r.lrange(name, 0, -1)
        elif kind == "stream":
            found += [x for _, fields in await r.xrange(name) for kv in fields.items() for x in kv]
    await r.aclose()
    return found


def holds_private_key(values: list[bytes], signer: GrantSigner) -> bool:
    pem = signer.to_pem()
    raw = pem.split(b"-----")[2].strip()  # the base64 body of the PEM
    return any(pem in v or raw in v or b"PRIVATE KEY" in v for v in values if v)


async def test_redis_holds_no_private_key(setup, redis_server, tmp_path):
    key_file = tmp_path / "grant.pem"
    signer = GrantSigner.create_file(key_file)
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    legacy = TenantKeys(setup.key_prefix).legacy_grant_signing_key
    r = aioredis.from_url(redis_server.url)
    await r.set(legacy, GrantSigner.generate().to_pem())  # what earlier versions stored
    await setup.start_cp(key_file)
    consumer_key = await setup.node_key("consumer")
    async with channel(setup.address, setup.admin_key) as ch:
        await tpb_grpc.TenantAdminStub(ch).CreateTenant(tpb.CreateTenantRequest(tenant_id=NS.tenant))
    assert await setup.grant(consumer_key)  # the control plane signs: the key is in use
    assert not await r.exists(legacy), "the key earlier versions kept in Redis is deleted at start"
    assert not holds_private_key(await redis_values(redis_server.url), signer)

    # Positive control: the scan finds the key when it is there.
    scratch = f"{setup.key_prefix}:scratch:{uuid.uuid4().hex}"
    await r.hset(scratch, "k", signer.to_pem())
    try:
        assert holds_private_key(await redis_values(redis_server.url), signer)
    finally:
        await r.delete(scratch)
        await r.aclose()


async def test_a_key_file_others_may_read_is_refused(setup, tmp_path):
    key_file = tmp_path / "grant.pem"
    GrantSigner.create_file(key_file)
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        await setup.start_cp(key_file)
    key_file.chmod(0o600)
    await setup.start_cp(key_file)  # control: the same file, private, is accepted
