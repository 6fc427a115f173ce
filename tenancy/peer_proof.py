"""Peer calls authenticated by proof of possession, so a node's API key never leaves it for a peer.

Each data plane makes an Ed25519 key pair at start (:class:`NodeIdentity`); its private key never leaves
the process. The control plane binds the public key into the pull grants it issues to that node (the node
asks with its API key, over the control-plane channel only). A peer call (ExchangeAgentMetadata, Lookup,
Release) carries the grant and a proof: the consumer's signature over the grant's digest, the method, the
digest of the request's fields (kvmesh.request_digest: lease id, landing addresses, hashes, agent metadata...),
the target node id, a timestamp and a nonce. The source accepts it only for itself, that method, that request,
within ``WINDOW_MS`` of its clock, once (nonces are remembered for the window, :class:`NonceCache`): a proof
captured on the way to one node or call is worth nothing at another node, another call, with other
arguments, or later.

Proof format (``kvmesh-proof`` metadata): ``<unix_ms>.<nonce: 24 hex digits>.<base64url signature>``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import Message

from kvmesh.errors import PermissionDenied, ResourceExhausted
from kvmesh.request_digest import request_digest

PROOF_METADATA = "kvmesh-proof"
WINDOW_MS = 30_000
MAX_LIVE_NONCES = 262_144  # about 20 MiB of remembered proofs; more within the window are refused
_DOMAIN = b"kvmesh-peer-proof-v2"
_PROOF = re.compile(r"([0-9]{1,15})\.([0-9a-f]{24})\.([A-Za-z0-9_-]{86})")  # 86: a 64-byte signature


@dataclass(frozen=True, slots=True)
class PeerCall:
    """What one proof is made for: a method of the DataPlane service and the digest of its request."""

    method: str
    request_digest: bytes

    @classmethod
    def of(cls, method: str, request: Message) -> "PeerCall":
        return cls(method, request_digest(request))


def _message(grant: bytes, call: PeerCall, target_node_id: str, unix_ms: int, nonce: str) -> bytes:
    return b"\n".join([_DOMAIN, hashlib.sha256(grant).hexdigest().encode(), call.method.encode(),
                       call.request_digest.hex().encode(), target_node_id.encode(), str(unix_ms).encode(),
                       nonce.encode()])


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

    def proof(self, grant: bytes, call: PeerCall, target_node_id: str) -> str:
        unix_ms, nonce = int(time.time() * 1000), os.urandom(12).hex()
        signature = self._key.sign(_message(grant, call, target_node_id, unix_ms, nonce))
        return f"{unix_ms}.{nonce}.{_b64(signature)}"


class NonceCache:
    """The nonces of accepted proofs, each kept for ``keep_ms`` after its proof's timestamp (and at most one
    bucket, ``keep_ms / buckets``, longer): past then no proof with that timestamp passes the window again.

    One set per time bucket of the proofs' own timestamps (a replay carries the same timestamp: one set to
    look in); whole buckets expire from the oldest. Each :meth:`add` costs O(1), amortised (at most
    ``buckets + 2`` buckets are visited to expire, each nonce is dropped once), and at most ``capacity``
    nonces are held: a grant holder minting proofs without limit is refused (ResourceExhausted) until its
    oldest ones expire, never slowing the check down or growing memory past the bound.
    """

    def __init__(self, keep_ms: int, capacity: int = MAX_LIVE_NONCES, buckets: int = 16,
                 what: str = "peer proofs") -> None:
        self._what = what
        self._keep_ms = keep_ms
        self._bucket_ms = max(1, -(-keep_ms // buckets))
        self._capacity = capacity
        self._sets: dict[int, set[int]] = {}
        self._oldest = 0  # no bucket below this index is held
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, nonce: int, unix_ms: int, now_ms: int) -> bool:
        """Remembers ``nonce`` of a proof made at ``unix_ms``; False if it was already there."""
        self._expire(now_ms)
        index = unix_ms // self._bucket_ms
        bucket = self._sets.get(index)
        if bucket is not None and nonce in bucket:
            return False
        if self._size >= self._capacity:
            raise ResourceExhausted(f"this node holds {self._size} {self._what} of the last {self._keep_ms} ms "
                                    "(its bound): retry later")
        if bucket is None:
            bucket = self._sets[index] = set()
            self._oldest = min(self._oldest, index) if self._size else index
        bucket.add(nonce)
        self._size += 1
        return True

    def _expire(self, now_ms: int) -> None:
        cutoff = (now_ms - self._keep_ms) // self._bucket_ms  # buckets below it hold only expired proofs
        if cutoff <= self._oldest:
            return
        if cutoff - self._oldest <= len(self._sets):
            stale = range(self._oldest, cutoff)
        else:  # idle for long: fewer held buckets than indexes skipped
            stale = [index for index in self._sets if index < cutoff]
        for index in stale:
            self._size -= len(self._sets.pop(index, ()))
        self._oldest = cutoff


class ProofVerifier:
    """Checks proofs on a source node: signature by the grant's consumer key, target, method, request, window,
    replay. Every refusal is PermissionDenied (ResourceExhausted: the nonce cache is full)."""

    def __init__(self, node_id: str, window_ms: int = WINDOW_MS, max_live_nonces: int = MAX_LIVE_NONCES) -> None:
        self._node_id = node_id
        self._window_ms = window_ms
        self._seen = NonceCache(2 * window_ms, max_live_nonces)

    def verify(self, grant: bytes, consumer_public_key: str, proof: str, call: PeerCall,
               now_ms: int | None = None) -> None:
        if not proof:
            raise PermissionDenied("a peer call needs a proof of possession of the grant's key (kvmesh-proof)")
        matched = _PROOF.fullmatch(proof) if isinstance(proof, str) else None
        if matched is None:
            raise PermissionDenied("malformed peer proof (<unix ms>.<24 hex digits>.<base64url signature>)")
        unix_ms, nonce, signature = int(matched[1]), matched[2], base64.urlsafe_b64decode(matched[3] + "==")
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if abs(now_ms - unix_ms) > self._window_ms:
            raise PermissionDenied("peer proof is outside its time window (replayed, or clocks disagree)")
        key = decode_public_key(consumer_public_key)
        try:
            key.verify(signature, _message(grant, call, self._node_id, unix_ms, nonce))
        except InvalidSignature:
            raise PermissionDenied("peer proof does not verify (another node, call, request or key)") from None
        if not self._seen.add(int(nonce, 16), unix_ms, now_ms):
            raise PermissionDenied("peer proof replayed")
