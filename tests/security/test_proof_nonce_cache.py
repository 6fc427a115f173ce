"""A grant holder minting proofs without limit cannot slow a source's proof check down or grow its memory past a
bound (issue 19): the nonce cache costs the same per proof with 1,000 or 40,000 live nonces, holds at most its
capacity (more live proofs are refused, RESOURCE_EXHAUSTED, until the oldest expire) and forgets each nonce once
no proof with its timestamp can pass the window again. Replays stay refused throughout (negative control), and
fresh proofs are accepted again once the flood's nonces expire (positive control).

Real Ed25519 keys and proofs, checked by the source's own verifier (tenancy.peer_proof) with its clock given, so
the test controls time; a real data plane's proof check (tests/security/test_node_key_peer_calls.py) is the same
object.
"""

from __future__ import annotations

import time

import pytest

from kvmesh.errors import PermissionDenied, ResourceExhausted
from kvmesh.v1 import data_plane_pb2 as dp_pb
from tenancy.peer_proof import WINDOW_MS, NodeIdentity, PeerCall, ProofVerifier, encode_public_key

pytestmark = pytest.mark.slow

GRANT = b"a-grant-token"  # the verifier checks proofs against the key a verified grant names; any bytes do here
CALL = PeerCall.of("Release", dp_pb.ReleaseRequest(lease_id="x"))


def minted(identity: NodeIdentity, n: int) -> list[tuple[str, int]]:
    """``n`` proofs of one grant holder, with the (real) time each was made."""
    out = []
    for _ in range(n):
        proof = identity.proof(GRANT, CALL, "src")
        out.append((proof, int(proof.split(".")[0])))
    return out


def cpu_seconds(verifier: ProofVerifier, key: str, proofs: list[tuple[str, int]], now_ms: int) -> float:
    start = time.process_time()
    for proof, _ in proofs:
        verifier.verify(GRANT, key, proof, CALL, now_ms=now_ms)
    return time.process_time() - start


def test_the_cost_per_proof_does_not_grow_with_the_live_nonces():
    me = NodeIdentity()
    key = encode_public_key(me.public_key)
    proofs = minted(me, 40_000)
    now_ms = proofs[-1][1]  # every proof is within the window
    verifier = ProofVerifier("src")
    first = cpu_seconds(verifier, key, proofs[:2_000], now_ms)
    cpu_seconds(verifier, key, proofs[2_000:38_000], now_ms)
    last = cpu_seconds(verifier, key, proofs[38_000:], now_ms)  # with 38,000 nonces live
    assert last < 2.5 * first, f"2,000 proofs cost {first:.3f}s of CPU with few nonces live, {last:.3f}s with 38,000"
    with pytest.raises(PermissionDenied, match="replayed"):
        verifier.verify(GRANT, key, proofs[0][0], CALL, now_ms=now_ms)


def test_the_live_nonces_are_bounded_and_expire(monkeypatch):
    me = NodeIdentity()
    key = encode_public_key(me.public_key)
    proofs = minted(me, 1_001)
    now_ms = proofs[-1][1]
    verifier = ProofVerifier("src", max_live_nonces=1_000)
    for proof, _ in proofs[:1_000]:
        verifier.verify(GRANT, key, proof, CALL, now_ms=now_ms)
    with pytest.raises(ResourceExhausted, match="retry later"):
        verifier.verify(GRANT, key, proofs[1_000][0], CALL, now_ms=now_ms)
    with pytest.raises(PermissionDenied, match="replayed"):  # a full cache still knows every nonce it holds
        verifier.verify(GRANT, key, proofs[0][0], CALL, now_ms=now_ms)
    # Two windows and a bucket (1/16 of them) later the flood's nonces are gone: as many fresh proofs (made
    # then) are accepted, and the old ones are refused by their timestamp.
    later_ms = now_ms + 2 * WINDOW_MS + 2 * WINDOW_MS // 16 + 1_000
    monkeypatch.setattr("tenancy.peer_proof.time.time", lambda: later_ms / 1000)
    for proof, _ in minted(me, 1_000):
        verifier.verify(GRANT, key, proof, CALL, now_ms=later_ms)
    with pytest.raises(PermissionDenied, match="time window"):
        verifier.verify(GRANT, key, proofs[0][0], CALL, now_ms=later_ms)
