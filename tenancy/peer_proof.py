"""Peer calls authenticated by proof of possession, so a node's API key never leaves it for a peer.

Each data plane makes an Ed25519 key pair at start (:class:`NodeIdentity`); its private key never leaves
the process. The control plane binds the public key into the pull grants it issues to that node (the node
asks with its API key, over the control-plane channel only). A peer call (ExchangeAgentMetadata, Lookup,
Release) carries the grant and a proof: the consumer's signature over the grant's digest, the method, the
target node id, a timestamp and a nonce. The source accepts it only for itself, that method, within
``WINDOW_MS`` of its clock, once (nonces are remembered for the window): a proof captured on the way to
one node or call is worth nothing at another node, another call, or later.

Proof format (``kvmesh-proof`` metadata): ``<unix_ms>.<nonce hex>.<base64url signature>``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvmesh.errors import PermissionDenied

PROOF_METADATA = "kvmesh-proof"
WINDOW_MS = 30_000
_DOMAIN = b"kvmesh-peer-proof-v1"


def _message(grant: bytes, method: str, target_node_id: str, unix_ms: int, nonce: str) -> bytes:
    return b"\n".join([_DOMAIN, hashlib.sha256(grant).hexdigest().encode(), method.encode(),
                       target_node_id.encode(), str(unix_ms).encode(), nonce.encode()])


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def encode_public_key(raw: bytes) -> str:
    return _b64(raw)


def decode_public_key(text: str) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (ValueError, TypeError):
        raise PermissionDenied("the grant binds no valid consumer public key") from None


class NodeIdentity:
    """This process's peer key pair (made at start, never written anywhere)."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public_key = self._key.public_key().public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw)

    def proof(self, grant: bytes, method: str, target_node_id: str) -> str:
        unix_ms, nonce = int(time.time() * 1000), os.urandom(12).hex()
        signature = self._key.sign(_message(grant, method, target_node_id, unix_ms, nonce))
        return f"{unix_ms}.{nonce}.{_b64(signature)}"


class ProofVerifier:
    """Checks proofs on a source node: signature by the grant's consumer key, target, method, window, replay."""

    def __init__(self, node_id: str, window_ms: int = WINDOW_MS) -> None:
        self._node_id = node_id
        self._window_ms = window_ms
        self._seen: dict[str, int] = {}  # nonce -> when it may be forgotten (unix ms)

    def verify(self, grant: bytes, consumer_public_key: str, proof: str, method: str,
               now_ms: int | None = None) -> None:
        if not proof:
            raise PermissionDenied("a peer call needs a proof of possession of the grant's key (kvmesh-proof)")
        try:
            unix_ms_text, nonce, sig = proof.split(".")
            unix_ms = int(unix_ms_text)
            signature = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
        except ValueError:
            raise PermissionDenied("malformed peer proof") from None
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if abs(now_ms - unix_ms) > self._window_ms:
            raise PermissionDenied("peer proof is outside its time window (replayed, or clocks disagree)")
        key = decode_public_key(consumer_public_key)
        try:
            key.verify(signature, _message(grant, method, self._node_id, unix_ms, nonce))
        except InvalidSignature:
            raise PermissionDenied("peer proof does not verify (another node, call or key)") from None
        self._forget(now_ms)
        if nonce in self._seen:
            raise PermissionDenied("peer proof replayed")
        self._seen[nonce] = unix_ms + 2 * self._window_ms

    def _forget(self, now_ms: int) -> None:
        if len(self._seen) > 1024:
            self._seen = {n: until for n, until in self._seen.items() if until > now_ms}
