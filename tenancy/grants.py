"""Pull grants: short-lived capabilities, signed by the control plane, checked by data planes.

A source data plane serves a peer's Lookup or Pull only with a grant that names
the tenant, the namespace (fingerprint), the consumer node and the very key it
authenticates with, the source node, and an expiry. Grants are Ed25519-signed:
data planes hold only the public key, so a compromised data plane cannot mint
grants. Token: ``base64url(json payload) "." base64url(signature)``.
"""

from __future__ import annotations

import base64
import hmac
import json
import time
from dataclasses import asdict, dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvmesh.errors import PermissionDenied


@dataclass(frozen=True, slots=True)
class Grant:
    tenant: str
    namespace_fingerprint: str
    consumer_node_id: str
    consumer_key_id: str
    consumer_key_hash: str
    source_node_id: str
    expires_unix_ms: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class GrantSigner:
    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key

    @classmethod
    def generate(cls) -> "GrantSigner":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, pem: bytes) -> "GrantSigner":
        key = serialization.load_pem_private_key(pem, password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("the grant-signing key must be an Ed25519 private key")
        return cls(key)

    def to_pem(self) -> bytes:
        return self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())

    @property
    def public_key(self) -> bytes:
        return self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, grant: Grant) -> bytes:
        payload = json.dumps(asdict(grant), sort_keys=True, separators=(",", ":")).encode()
        return f"{_b64(payload)}.{_b64(self._key.sign(payload))}".encode()


class GrantVerifier:
    """Checks grants on a source data plane. Every failure is PermissionDenied with the reason."""

    def __init__(self, public_key: bytes, node_id: str) -> None:
        self._key = Ed25519PublicKey.from_public_bytes(public_key)
        self._node_id = node_id

    def verify(self, token: bytes, *, key_id: str, key_hash: str, namespace_fingerprint: str | None,
               now_ms: int | None = None) -> Grant:
        """``key_id``/``key_hash``: the key the caller authenticated with. ``namespace_fingerprint``
        None: any namespace (calls that name none, e.g. the NIXL handshake)."""
        if not token:
            raise PermissionDenied("this call needs a pull grant from the control plane")
        try:
            payload_b64, sig_b64 = token.decode().split(".")
            payload = _unb64(payload_b64)
            self._key.verify(_unb64(sig_b64), payload)
            grant = Grant(**json.loads(payload))
        except (ValueError, TypeError, UnicodeDecodeError, InvalidSignature):
            raise PermissionDenied("invalid pull grant") from None
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if grant.expires_unix_ms <= now_ms:
            raise PermissionDenied("pull grant expired")
        if grant.source_node_id != self._node_id:
            raise PermissionDenied("pull grant is for another source node")
        if namespace_fingerprint is not None and grant.namespace_fingerprint != namespace_fingerprint:
            raise PermissionDenied("pull grant is for another namespace")
        if key_id != grant.consumer_key_id or not hmac.compare_digest(key_hash, grant.consumer_key_hash):
            raise PermissionDenied("pull grant was issued to another node")
        return grant
