"""The peer API behind its gate: Send (Lookup with a lease and landing addresses), Release and the handshake,
fuzzed by a peer that holds a real grant (signed by the control plane's key) and proves it for each request (a
proof of possession over that request's digest), so every request reaches the handler; and grants whose claims,
signed as they are, have fields of any JSON type.

The peer is this process: a NIXL agent with a registered buffer, handshaken with the data plane, and a lease on
blocks committed there taken by a real Lookup before each send. Each answer must be a documented status with a
clear message, no traceback may be logged, and the data plane keeps serving. Positive controls: the well-formed
send writes the committed bytes into the peer's buffer, and each fuzz test checks how many requests got past
the gate (none is refused for its grant or proof) so that the fuzz is not all bounced at the door.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import time
import uuid

import grpc
import numpy as np
from cryptography.hazmat.primitives import serialization
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import data_plane_pb2 as pb
from tenancy.auth import GRANT_METADATA
from tenancy.grants import Grant
from tenancy.peer_proof import PROOF_METADATA, NodeIdentity, PeerCall, encode_public_key

from data_plane.server import TRANSFERS_HEALTH

from tests.agent_challenge import challenge_nonce_blocking, drop_notifications
from tests.fuzz.conftest import BLOCK_BYTES, TENANT
from tests.fuzz.proto_strategies import message
from tests.fuzz.test_rpc_fuzz import FUZZ, _call, _check, tracebacks  # noqa: F401 - tracebacks: a fixture

pytestmark = pytest.mark.nixl

NS = Namespace(TENANT, "fuzz-model", "v1", CacheConfig(block_size=32)).validate()
N = 4
SOURCE = "fuzz-node"
GATE = ("pull grant", "peer proof", "needs a pull grant", "proof of possession")  # refusals at the door


class Peer:
    """A granted peer of the fuzz data plane: its key, a NIXL agent with a buffer, committed blocks to ask for."""

    def __init__(self, services, channel) -> None:
        wait_transfers_ready(channel)  # the data plane's own NIXL agent first (nixl is imported by its thread)
        from nixl._api import nixl_agent, nixl_agent_config

        self.services, self.channel = services, channel
        self.identity = NodeIdentity()
        self.node_id = "fuzz-peer"
        self.agent = nixl_agent(f"{self.node_id}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))
        self.buf = np.zeros(N * BLOCK_BYTES, dtype=np.uint8)
        self._reg = self.agent.register_memory([(self.buf.ctypes.data, self.buf.nbytes, 0, "")], "DRAM")
        self.grant = self.sign(self.claims())
        self.hashes = [os.urandom(32) for _ in range(N)]
        local = (("authorization", f"Bearer {services.node_key}"),)
        assert self.call("Reserve", pb.ReserveRequest(namespace=NS.to_proto(), block_hashes=self.hashes),
                         local)[0] == grpc.StatusCode.OK
        assert self.call("Commit", pb.CommitRequest(namespace=NS.to_proto(), block_hashes=self.hashes),
                         local)[0] == grpc.StatusCode.OK
        self.handshake()

    def claims(self, **fields) -> dict:
        now_ms = int(time.time() * 1000)
        grant = Grant(TENANT, NS.fingerprint, self.node_id, encode_public_key(self.identity.public_key), SOURCE,
                      now_ms + 3_600_000, key_id=self.services.signer.key_id, issued_unix_ms=now_ms)
        return {**dataclasses.asdict(grant), **fields}

    def sign(self, claims: dict) -> bytes:
        """Claims signed by the control plane's key as they are (GrantSigner.sign, minus its dataclass)."""
        key = serialization.load_pem_private_key(self.services.signer.to_pem(), password=None)
        payload = json.dumps(claims, sort_keys=True).encode()
        b64 = lambda data: base64.urlsafe_b64encode(data).decode().rstrip("=")  # noqa: E731
        return f"{b64(payload)}.{b64(key.sign(payload))}".encode()

    def call(self, method: str, request, metadata) -> tuple:
        return _call(self.channel, f"/kvmesh.v1.DataPlane/{method}", False, [request.SerializeToString()], metadata)

    def peer_call(self, method: str, request, grant: bytes | None = None) -> tuple:
        grant = self.grant if grant is None else grant
        proof = self.identity.proof(grant, PeerCall.of(method, request), SOURCE)
        return self.call(method, request, ((GRANT_METADATA, grant.decode()), (PROOF_METADATA, proof)))

    def reply(self, method: str, request):
        """The data plane's reply to a granted peer call that must succeed."""
        proof = self.identity.proof(self.grant, PeerCall.of(method, request), SOURCE)
        call = self.channel.unary_unary(f"/kvmesh.v1.DataPlane/{method}",
                                        request_serializer=type(request).SerializeToString,
                                        response_deserializer=getattr(pb, f"{method}Response").FromString)
        return call(request, metadata=((GRANT_METADATA, self.grant.decode()), (PROOF_METADATA, proof)), timeout=15)

    def handshake(self) -> None:
        """The peer's whole handshake, as a data plane's: its agent's metadata, then the challenge that agent got
        (only then does the data plane WRITE to it)."""
        drop_notifications(self.agent)
        hs = self.reply("ExchangeAgentMetadata", pb.ExchangeAgentMetadataRequest(
            node_id=self.node_id, block_bytes=BLOCK_BYTES, agent_metadata=self.agent.get_agent_metadata()))
        assert hs.agent_challenge_sent, hs
        self.reply("ExchangeAgentMetadata", pb.ExchangeAgentMetadataRequest(
            node_id=self.node_id, block_bytes=BLOCK_BYTES,
            agent_challenge_answer=challenge_nonce_blocking(self.agent, hs.agent_name, hs.agent_challenge_digest)))

    def lease(self) -> str:
        """A fresh lease on the committed blocks (a real granted Lookup)."""
        request = pb.LookupRequest(namespace=NS.to_proto(), block_hashes=self.hashes, lease_ms=5_000)
        reply = self.reply("Lookup", request)
        assert reply.lease_id, reply
        return reply.lease_id

    def landing(self, n: int = N) -> list[int]:
        return [self.buf.ctypes.data + i * BLOCK_BYTES for i in range(n)]

    def close(self) -> None:
        self.agent.deregister_memory(self._reg)


def wait_transfers_ready(channel, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    check = health_pb2_grpc.HealthStub(channel).Check
    while check(health_pb2.HealthCheckRequest(service=TRANSFERS_HEALTH), timeout=10).status != \
            health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "the data plane's NIXL agent did not start"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def peer(services):
    ch = grpc.insecure_channel(services.dp_address)
    peer = Peer(services, ch)
    yield peer
    peer.close()
    ch.close()


def test_the_well_formed_send_writes_the_blocks(peer, tracebacks):
    """Positive control of the fuzz below: the same peer's send of its lease brings the committed bytes."""
    peer.buf[:] = 0xAB
    request = pb.LookupRequest(namespace=NS.to_proto(), block_hashes=peer.hashes, lease_id=peer.lease(),
                               landing_addrs=peer.landing())
    code, details = peer.peer_call("Lookup", request)
    _check(code, details, "send", tracebacks)
    assert code == grpc.StatusCode.OK
    assert not peer.buf.any(), "the committed (zeroed) blocks were written over the buffer"


def _landing(peer, n: int) -> st.SearchStrategy:
    """``n`` landing addresses: the peer's slots, any address in or around its buffer, any uint64."""
    base, end = peer.buf.ctypes.data, peer.buf.ctypes.data + N * BLOCK_BYTES
    return st.one_of(st.just(peer.landing(n)), st.lists(st.integers(base - BLOCK_BYTES, end), min_size=n, max_size=n),
                     st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n),
                     st.permutations(peer.landing(N)).map(lambda addrs: addrs[:n]) if n <= N else st.nothing())


@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_fuzzed_sends_get_documented_statuses(peer, tracebacks, data):
    hashes = data.draw(st.one_of(st.permutations(peer.hashes), st.lists(st.sampled_from(peer.hashes), max_size=N + 1),
                                 st.lists(st.binary(max_size=40), max_size=N + 1),
                                 st.integers(0, N).map(lambda n: peer.hashes[:n])), label="hashes")
    count = data.draw(st.one_of(st.just(len(hashes)), st.integers(0, N + 1)), label="landing addresses")
    addrs = data.draw(_landing(peer, count), label="addrs")
    lease = data.draw(st.one_of(st.just(None), st.text(max_size=40)), label="lease")  # None: a fresh lease of its own
    request = pb.LookupRequest(namespace=NS.to_proto(), block_hashes=list(hashes), landing_addrs=addrs,
                               lease_id=peer.lease() if lease is None else lease)
    code, details = peer.peer_call("Lookup", request)
    _check(code, details, f"send({request})", tracebacks)
    assert not any(g in details for g in GATE), details  # every one of these reached the handler
    if lease is None:  # a send refused before its WRITE leaves the lease: its pins count against the peer's share
        peer.reply("Release", pb.ReleaseRequest(lease_id=request.lease_id))


@FUZZ
@given(data=st.data())
def test_fuzzed_releases_and_handshakes_get_documented_statuses(peer, tracebacks, data):
    method = data.draw(st.sampled_from(["Release", "ExchangeAgentMetadata"]))
    hints = {"node_id": st.just(peer.node_id), "block_bytes": st.just(BLOCK_BYTES),
             "agent_metadata": st.one_of(st.just(peer.agent.get_agent_metadata()), st.binary(max_size=64)),
             "lease_id": st.one_of(st.just("x"), st.text(max_size=40))}
    descriptor = getattr(pb, f"{method}Request").DESCRIPTOR
    request = data.draw(st.one_of(message(descriptor, hints), message(descriptor, hints, plausible=True)))
    code, details = peer.peer_call(method, request)
    _check(code, details, f"{method}({request})", tracebacks)
    assert not any(g in details for g in GATE), details
    peer.handshake()  # the peer's own agent is loaded again (a fuzzed handshake may have replaced it)


_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                               st.text(max_size=20)),
                     lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=3)), max_leaves=6)


@FUZZ
@given(data=st.data())
def test_signed_grants_with_fields_of_any_type_get_documented_statuses(peer, tracebacks, data):
    """Claims as the control plane's key signs them, each field of its type or any JSON value (the real signing
    key, so a claim of the right type passes the signature and reaches what uses it)."""
    names = [f.name for f in dataclasses.fields(Grant)]
    changed = data.draw(st.dictionaries(st.sampled_from(names + ["extra"]), _JSON, min_size=1, max_size=3))
    grant = peer.sign(peer.claims(**changed))
    method = data.draw(st.sampled_from(["Lookup", "Release", "ExchangeAgentMetadata"]))
    request = {"Lookup": pb.LookupRequest(namespace=NS.to_proto(), block_hashes=peer.hashes[:1]),
               "Release": pb.ReleaseRequest(lease_id="x"),
               "ExchangeAgentMetadata": pb.ExchangeAgentMetadataRequest(node_id=peer.node_id, block_bytes=BLOCK_BYTES)}
    code, details = peer.peer_call(method, request[method], grant)
    _check(code, details, f"{method} with claims {changed}", tracebacks)
