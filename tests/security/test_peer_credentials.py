"""A peer's credentials, malformed or captured (issue 19), tried against real data-plane processes.

* Every field of a grant and of a proof is type-checked before use: a ``kvmesh-grant`` whose ``key_id`` is a list
  or an object, any field of the wrong type, JSON that is no object or nests deeper than the parser goes, and
  malformed proofs are refused (PERMISSION_DENIED, like a forged grant) on each peer RPC, with no traceback in
  the source's log, no credential needed to try. A local Pull carrying such a grant is refused on the consumer,
  before any source is dialed. Positive control: the same calls with the real grant are served.
* A proof covers a digest of its request: an attacker who captured a consumer's grant and proof on the way (a
  link without TLS) and races them with other arguments (its own NIXL agent in the handshake, another answer to
  its challenge; its own landing addresses in the send) is refused, and not one byte reaches it. Positive
  control: the consumer's own requests, with those very proofs, go through afterwards and bring the source's
  bytes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time

import grpc
import pytest

from kvmesh.v1 import data_plane_pb2 as dp_pb, data_plane_pb2_grpc as dp_grpc
from tenancy.auth import GRANT_METADATA
from tenancy.peer_proof import PROOF_METADATA, NodeIdentity, PeerCall

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.types import LookupStatus

from tests.agent_challenge import challenge_nonce, drop_notifications, handshake
from tests.security.test_byte_path_gating import (  # noqa: F401 - fleet, attacker: fixtures
    BLOCK, N, TENANT_A, as_peer, attacker, fleet, nixl_agent_with_buffer, peer_key_of, store,
)

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def reshaped(token: bytes, **fields) -> bytes:
    """``token``'s claims with ``fields`` changed (its signature kept: the claims are refused before it matters)."""
    payload, signature = token.decode().split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return f"{b64(json.dumps({**claims, **fields}).encode())}.{signature}".encode()


def malformed_grants(good: bytes) -> dict[str, bytes]:
    signature = good.decode().split(".")[1]
    cases = {
        "key_id a list": reshaped(good, key_id=["a", "b"]),
        "key_id an object": reshaped(good, key_id={"k": 1}),
        "key_id null": reshaped(good, key_id=None),
        "expires a string": reshaped(good, expires_unix_ms="never"),
        "expires a bool": reshaped(good, expires_unix_ms=True),
        "expires a float": reshaped(good, expires_unix_ms=1e300),
        "tenant epoch a list": reshaped(good, tenant_epoch=[]),
        "consumer key a number": reshaped(good, consumer_public_key=7),
        "source node an object": reshaped(good, source_node_id={"id": "src-gated"}),
        "an unknown field": reshaped(good, admin=True),
    }
    for body in ([1, 2], "grant", 42, None, "[" * 1500 + "]" * 1500, '{"":' * 1100):
        text = body if isinstance(body, str) and body[:1] in "[{" else json.dumps(body)
        cases[f"payload {text[:12]!r}"] = f"{b64(text.encode())}.{signature}".encode()
    cases["no signature"] = good.split(b".")[0]
    cases["three parts"] = good + b".x"
    return cases


async def raw_reply(address: str, method: str, request, grant: bytes, proof: str):
    """A peer call with exactly this grant and proof (what an attacker replays); the status, details and reply."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            reply = await getattr(dp_grpc.DataPlaneStub(ch), method)(
                request, metadata=((GRANT_METADATA, grant.decode()), (PROOF_METADATA, proof)), timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details(), None
    return grpc.StatusCode.OK, "", reply


async def raw(address: str, method: str, request, grant: bytes, proof: str):
    """:func:`raw_reply`'s status and details."""
    return (await raw_reply(address, method, request, grant, proof))[:2]


def tracebacks(proc) -> list[str]:
    return [line for line in proc.output if "Traceback" in line or "unhandled error" in line]


async def test_malformed_grants_and_proofs_are_refused_on_every_peer_call(fleet):
    source = fleet.start("src-gated")
    me = NodeIdentity()
    good = fleet.grant(me.public_key, "peer", "src-gated", TENANT_A)
    hashes, _ = await store(source, TENANT_A)
    requests = {
        "Lookup": dp_pb.LookupRequest(namespace=TENANT_A.to_proto(), block_hashes=hashes),
        "ExchangeAgentMetadata": dp_pb.ExchangeAgentMetadataRequest(node_id="peer", block_bytes=BLOCK),
        "Release": dp_pb.ReleaseRequest(lease_id="0" * 32),
    }

    def proof(grant: bytes, method: str) -> str:
        return me.proof(grant, PeerCall.of(method, requests[method]), "src-gated")

    for method, request in requests.items():  # positive control: the real grant is served
        assert await raw(source.address, method, request, good, proof(good, method)) == (grpc.StatusCode.OK, "")
    for what, grant in malformed_grants(good).items():
        for method, request in requests.items():
            code, details = await raw(source.address, method, request, grant, proof(grant, method))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "invalid pull grant" in details, \
                (what, method, code, details)
    signature = me.proof(good, PeerCall.of("Release", requests["Release"]), "src-gated").split(".")[2]
    for bad in ("1.2.3", "x", f"{int(1e20)}.{'0' * 24}.{signature}", f"-5.{'0' * 24}.{signature}",
                f"1.{'g' * 24}.{signature}", f"1.{'0' * 2000}.{signature}", f"1.{'0' * 24}.{signature[:-2]}"):
        code, details = await raw(source.address, "Release", requests["Release"], good, bad)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "malformed peer proof" in details, (bad, code, details)
    assert await raw(source.address, "Release", requests["Release"], good, proof(good, "Release")) == \
        (grpc.StatusCode.OK, ""), "the source still serves"
    await asyncio.sleep(0.2)  # its log lines arrive through a pipe
    assert not tracebacks(source), "\n".join(source.output)


async def test_a_local_pull_with_a_malformed_grant_is_refused_before_any_source_is_dialed(fleet):
    source = fleet.start("src-gated")
    consumer = fleet.start("consumer")
    hashes, secrets = await store(source, TENANT_A)
    good = fleet.grant(await peer_key_of(consumer), "consumer", "src-gated", TENANT_A)
    async with DataPlaneClient(consumer.address, key=consumer.api_key) as local:
        for key_id in (["a"], {"k": "v"}):
            result = await local.pull(TENANT_A, hashes, "src-gated", source.address,
                                      grant=reshaped(good, key_id=key_id))
            assert result.pulled == 0 and "invalid pull grant" in result.refused, result
        assert (await local.pull(TENANT_A, hashes, "src-gated", source.address, grant=good)).pulled == N  # control
        slots, lease = await local.acquire(TENANT_A, hashes)
        tier = SharedTier.open(await local.describe_tier())
        assert [bytes(tier.slot(s)) for s in slots] == secrets
        tier.close()
        await local.release(lease)
    await asyncio.sleep(0.2)
    assert not tracebacks(source), "\n".join(source.output)
    assert not tracebacks(consumer), "\n".join(consumer.output)


async def test_a_captured_proof_raced_with_other_arguments_is_refused(fleet, attacker):
    """The attacker holds no grant of its own: only what it read off the victim's link, which it races first."""
    agent, buf = attacker
    source = fleet.start("src-gated")
    hashes, secrets = await store(source, TENANT_A)
    victim_id = NodeIdentity()
    grant = fleet.grant(victim_id.public_key, "victim", "src-gated", TENANT_A)

    def proof(method: str, request) -> str:
        return victim_id.proof(grant, PeerCall.of(method, request), "src-gated")

    with nixl_agent_with_buffer("victim", N * BLOCK) as (victim_agent, victim_buf):
        # The victim's handshake, captured: the attacker swaps in its own NIXL agent under the victim's name.
        handshake = dp_pb.ExchangeAgentMetadataRequest(node_id="victim", block_bytes=BLOCK,
                                                       agent_metadata=victim_agent.get_agent_metadata())
        handshake_proof = proof("ExchangeAgentMetadata", handshake)
        swapped = dp_pb.ExchangeAgentMetadataRequest(node_id="victim", agent_metadata=agent.get_agent_metadata(),
                                                     block_bytes=BLOCK)
        code, details = await raw(source.address, "ExchangeAgentMetadata", swapped, grant, handshake_proof)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "does not verify" in details, (code, details)
        drop_notifications(victim_agent)
        code, details, reply = await raw_reply(source.address, "ExchangeAgentMetadata", handshake, grant,
                                               handshake_proof)
        assert (code, details) == (grpc.StatusCode.OK, ""), "the victim's own handshake, with that proof"
        # The victim answers the challenge its agent received (the handshake's second call), as a data plane does.
        answer = dp_pb.ExchangeAgentMetadataRequest(
            node_id="victim", block_bytes=BLOCK,
            agent_challenge_answer=await challenge_nonce(victim_agent, reply.agent_name, reply.agent_challenge_digest))
        answer_proof = proof("ExchangeAgentMetadata", answer)
        raced = dp_pb.ExchangeAgentMetadataRequest(node_id="victim", block_bytes=BLOCK,
                                                   agent_challenge_answer=os.urandom(32).hex().encode())
        code, details = await raw(source.address, "ExchangeAgentMetadata", raced, grant, answer_proof)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "does not verify" in details, (code, details)
        assert await raw(source.address, "ExchangeAgentMetadata", answer, grant, answer_proof) == \
            (grpc.StatusCode.OK, ""), "the victim's own answer, with that proof"

        async with as_peer(victim_id, source) as victim:
            answer, _ = await victim.lookup(TENANT_A, hashes, lease_ms=60_000, grant=grant)
        assert answer.statuses == [LookupStatus.HIT] * N
        # The victim's send, captured: the attacker swaps in landing addresses of its own buffer.
        send = dp_pb.LookupRequest(namespace=TENANT_A.to_proto(), block_hashes=hashes, lease_id=answer.lease_id,
                                   landing_addrs=[victim_buf.ctypes.data + i * BLOCK for i in range(N)])
        send_proof = proof("Lookup", send)
        for changed in (dict(landing_addrs=[buf.ctypes.data + i * BLOCK for i in range(N)]),
                        dict(lease_id=os.urandom(16).hex()), dict(block_hashes=hashes[:1], landing_addrs=[0])):
            raced = dp_pb.LookupRequest(**{f.name: v for f, v in send.ListFields()} | changed)
            code, details = await raw(source.address, "Lookup", raced, grant, send_proof)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "does not verify" in details, (changed, code, details)
        await asyncio.sleep(0.2)
        assert not buf.any(), "not one byte reached the attacker"
        assert await raw(source.address, "Lookup", send, grant, send_proof) == (grpc.StatusCode.OK, "")
        assert [bytes(victim_buf[i * BLOCK:(i + 1) * BLOCK]) for i in range(N)] == secrets, \
            "positive control: the victim's own send, with the proof the attacker saw, brings the bytes"


async def _once_cooled(call, within_s: float = 60.0):
    """``call()`` once the caller's node is no longer cooling down (nor waiting for the source's spare checking
    process) after metadata that failed the check: RESOURCE_EXHAUSTED until then."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.25)


async def test_agent_metadata_that_crashes_nixl_is_refused_and_the_source_keeps_serving(fleet, attacker):
    """One flipped byte in the UCX worker address (its version) aborts any process that loads it. A grant holder
    handing such metadata over is refused (a throwaway process loaded it first and died), the source keeps
    serving, and the same peer's real metadata then handshakes and is sent its blocks (positive control)."""
    agent, buf = attacker
    source = fleet.start("src-gated")
    hashes, secrets = await store(source, TENANT_A)
    me = NodeIdentity()
    grant = fleet.grant(me.public_key, "attacker", "src-gated", TENANT_A)
    crashing = bytearray(agent.get_agent_metadata())
    crashing[crashing.index(b"UCX|c") + len(b"UCX|c") + 8] ^= 0xFF  # the connection info's first byte
    async with as_peer(me, source) as peer:
        for attempt in range(2):  # a second try gets a fresh throwaway process, and the same answer
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _once_cooled(lambda: peer.exchange_agent_metadata("attacker", bytes(crashing), BLOCK,
                                                                         grant=grant))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert "crashed a NIXL agent" in refused.value.details()
            if attempt == 0:  # at once again: the node cools down (docs/security.md, HandshakeGate)
                with pytest.raises(grpc.aio.AioRpcError) as cooling:
                    await peer.exchange_agent_metadata("attacker", bytes(crashing), BLOCK, grant=grant)
                # refused: the node cools down, or waits for the source's spare checking process
                assert cooling.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, cooling.value
        assert source.proc.poll() is None, "the source is still running"
        await _once_cooled(lambda: handshake(peer, "attacker", agent, grant, BLOCK))  # the real metadata: served
        answer, _ = await peer.lookup(TENANT_A, hashes, lease_ms=30_000, grant=grant)
        landing = [buf.ctypes.data + i * BLOCK for i in range(N)]
        assert await peer.send(TENANT_A, answer.lease_id, hashes, landing, grant=grant) == (N, BLOCK)
    assert [bytes(buf[i * BLOCK:(i + 1) * BLOCK]) for i in range(N)] == secrets
