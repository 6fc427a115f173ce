"""Pull grants: short-lived capabilities, signed by the control plane, checked by data planes.

A source data plane serves a peer's Lookup or Pull only with a grant that names
the tenant, the namespace (fingerprint), the consumer node and its peer public
key (the caller proves possession of it: tenancy.peer_proof), the source node
and its registered address, the tenant's epoch (the source serves only blocks
stored under it), and an expiry. Grants are Ed25519-signed:
data planes hold only the public key, so a compromised data plane cannot mint
grants. Token: ``base64url(json payload) "." base64url(signature)``.

The signing key is the operator's (a PEM file, :meth:`GrantSigner.from_file`), never
stored in Redis. Each grant names the id of the key that signed it and when it was
issued; a verifier holds every key currently accepted (the current one and, during
a rotation's overlap, earlier ones) and refuses grants signed by any other.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvmesh.errors import PermissionDenied


@dataclass(frozen=True, slots=True)
class Grant:
    tenant: str
    namespace_fingerprint: str
    consumer_node_id: str
    consumer_public_key: str  # the consumer's peer key (tenancy.peer_proof), base64url of the raw 32 bytes
    source_node_id: str
    expires_unix_ms: int
    source_address: str = ""  # the source's registered data-plane address (the only one to dial)
    key_id: str = ""  # of the key that signed it (set by GrantSigner.sign)
    issued_unix_ms: int = 0
    # the tenant's epoch when the grant was issued: a source serves it only blocks stored under that epoch,
    # so a grant for a re-created tenant never reaches its predecessor's bytes
    tenant_epoch: str = ""


@dataclass(frozen=True, slots=True)
class RouteToken:
    """``Route``'s signature on the source it named: with ``require_route_token`` a data plane pulls only from a
    source a request carries such a token for (fields differ from a Grant's, so neither passes as the other)."""

    route_tenant: str
    route_source_node_id: str
    route_source_address: str
    expires_unix_ms: int
    key_id: str = ""
    issued_unix_ms: int = 0


@dataclass(frozen=True, slots=True)
class PrefetchTicket:
    """``Route``'s order for one destination node to start a decided pull now (route-time prefetch): signed after
    the control plane checked the caller's rights on the tenant and that the tenant's policy allows the node. The
    destination pulls under its own grant; the ticket only says what to start (fields differ from a Grant's and a
    RouteToken's, so none passes as another)."""

    prefetch_tenant: str
    prefetch_namespace_fingerprint: str
    prefetch_destination_node_id: str
    prefetch_source_node_id: str
    prefetch_source_address: str
    prefetch_blocks_sha256: str  # of the block hashes, concatenated in chain order (prefetch_blocks_digest)
    prefetch_route_token: str  # the RouteToken of the same source (for nodes with require_route_token)
    expires_unix_ms: int
    key_id: str = ""
    issued_unix_ms: int = 0


def prefetch_blocks_digest(block_hashes: list[bytes]) -> str:
    """The digest a PrefetchTicket names its blocks by (each hash is fixed-size per namespace)."""
    return hashlib.sha256(b"".join(block_hashes)).hexdigest()


def key_id(public_key: bytes) -> str:
    """A grant key's id: the first 16 hex digits of the SHA-256 of its raw 32 bytes."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def public_key_from_pem(pem: bytes) -> bytes:
    """The raw Ed25519 public key of a PEM file holding either half of a key pair."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
        key = key.public_key() if isinstance(key, Ed25519PrivateKey) else None
    except (ValueError, TypeError):
        key = serialization.load_pem_public_key(pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("a grant key must be an Ed25519 key")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def read_key_file(path: str | Path) -> bytes:
    """A key file's bytes; ValueError when group or others may read it (it holds a private key)."""
    path = Path(path)
    mode = path.stat().st_mode
    if mode & 0o077:
        raise ValueError(f"{path} is readable by group or others (mode {mode & 0o777:o}): chmod 600 it")
    return path.read_bytes()


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

    @classmethod
    def from_file(cls, path: str | Path) -> "GrantSigner":
        return cls.from_pem(read_key_file(path))

    @classmethod
    def create_file(cls, path: str | Path) -> "GrantSigner":
        """A new key written to ``path`` (created exclusively, mode 0600)."""
        signer = cls.generate()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(signer.to_pem())
        return signer

    def to_pem(self) -> bytes:
        return self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())

    @property
    def public_key(self) -> bytes:
        return self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def key_id(self) -> str:
        return key_id(self.public_key)

    def sign(self, grant: Grant | RouteToken | PrefetchTicket) -> bytes:
        grant = dataclasses.replace(grant, key_id=self.key_id, issued_unix_ms=int(time.time() * 1000))
        payload = json.dumps(asdict(grant), sort_keys=True, separators=(",", ":")).encode()
        return f"{_b64(payload)}.{_b64(self._key.sign(payload))}".encode()


_TYPES = {"str": str, "int": int}


def _claims(kind, payload: bytes, what: str):
    """The claims of ``kind`` in a JSON ``payload``, every field of the type it is declared with (an int is
    never a bool) and none missing without a default: PermissionDenied otherwise, so nothing downstream (a
    key lookup, a comparison) meets a list, an object or a null."""
    try:
        fields = json.loads(payload)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise PermissionDenied(f"invalid {what}: not JSON") from None
    if not isinstance(fields, dict):
        raise PermissionDenied(f"invalid {what}: not a JSON object")
    declared = {f.name: _TYPES[f.type] for f in dataclasses.fields(kind)}
    for name, value in fields.items():
        expected = declared.get(name)
        if expected is None:
            raise PermissionDenied(f"invalid {what}: unknown field {name[:40]!r}")
        if type(value) is not expected:
            raise PermissionDenied(f"invalid {what}: {name} must be {'an integer' if expected is int else 'a string'}")
    try:
        return kind(**fields)
    except TypeError:  # a field without a default is missing
        raise PermissionDenied(f"invalid {what}: missing fields") from None


def _split(token: bytes, what: str) -> tuple[bytes, bytes]:
    """A token's JSON payload and signature (PermissionDenied when it is not ``payload.signature``)."""
    try:
        payload_b64, sig_b64 = token.decode("ascii").split(".")
        return _unb64(payload_b64), _unb64(sig_b64)
    except (ValueError, TypeError, AttributeError):  # UnicodeDecodeError and binascii.Error are ValueErrors
        raise PermissionDenied(f"invalid {what}") from None


def read_grant(token: bytes) -> Grant:
    """A grant's claims WITHOUT checking its signature: for the consumer, which got the token from the control
    plane (or its own local caller) and needs its tenant epoch; the source checks the signature.
    PermissionDenied when it is not a grant."""
    return _claims(Grant, _split(token, "pull grant")[0], "pull grant")


class UnknownGrantKey(PermissionDenied):
    """A grant signed by a key this verifier does not hold (a refresh may know it)."""


class GrantVerifier:
    """Checks grants on a source data plane. Every failure is PermissionDenied with the reason."""

    def __init__(self, public_keys: bytes | list[bytes], node_id: str) -> None:
        """``public_keys``: raw Ed25519 keys accepted (the current one and those in a rotation overlap)."""
        self._node_id = node_id
        self._keys: dict[str, Ed25519PublicKey] = {}
        self.set_keys([public_keys] if isinstance(public_keys, bytes) else public_keys)

    def set_keys(self, public_keys: list[bytes]) -> None:
        self._keys = {key_id(k): Ed25519PublicKey.from_public_bytes(k) for k in public_keys}

    def verify(self, token: bytes, *, namespace_fingerprint: str | None, now_ms: int | None = None) -> Grant:
        """``namespace_fingerprint`` None: any namespace (calls that name none, e.g. the NIXL handshake).
        Who presents it is checked by the caller: a proof of possession of ``consumer_public_key``."""
        if not token:
            raise PermissionDenied("this call needs a pull grant from the control plane")
        grant = self._open(token, Grant, "pull grant")
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if grant.expires_unix_ms <= now_ms:
            raise PermissionDenied("pull grant expired")
        if grant.source_node_id != self._node_id:
            raise PermissionDenied("pull grant is for another source node")
        if namespace_fingerprint is not None and grant.namespace_fingerprint != namespace_fingerprint:
            raise PermissionDenied("pull grant is for another namespace")
        return grant

    def verify_route(self, token: bytes, *, tenant: str, source_node_id: str, source_address: str,
                     now_ms: int | None = None) -> RouteToken:
        """A routing token for pulling ``tenant``'s blocks from this source node at this address
        (PermissionDenied otherwise: Route named that source for another tenant's request)."""
        if not token:
            raise PermissionDenied("this node pulls only from sources named by Route: the request carries no "
                                   "route_token")
        route = self._open(token, RouteToken, "route token")
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if route.expires_unix_ms <= now_ms:
            raise PermissionDenied("route token expired")
        if route.route_tenant != tenant:
            raise PermissionDenied(f"the route token is for tenant {route.route_tenant!r}, not {tenant!r}")
        if (route.route_source_node_id, route.route_source_address) != (source_node_id, source_address):
            raise PermissionDenied(f"the route token names {route.route_source_node_id} at "
                                   f"{route.route_source_address}, not {source_node_id} at {source_address}")
        return route

    def verify_prefetch(self, token: bytes, *, namespace_fingerprint: str, tenant: str, block_hashes: list[bytes],
                        now_ms: int | None = None) -> PrefetchTicket:
        """A prefetch ticket for this node, this tenant's namespace and exactly these blocks (PermissionDenied
        otherwise: issued for another node, namespace or prompt, expired, forged)."""
        if not token:
            raise PermissionDenied("a prefetch needs the ticket of Route's PrefetchOrder")
        ticket = self._open(token, PrefetchTicket, "prefetch ticket")
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if ticket.expires_unix_ms <= now_ms:
            raise PermissionDenied("prefetch ticket expired")
        if ticket.prefetch_destination_node_id != self._node_id:
            raise PermissionDenied(f"the prefetch ticket is for node {ticket.prefetch_destination_node_id!r}, "
                                   f"not {self._node_id!r}")
        if (ticket.prefetch_tenant, ticket.prefetch_namespace_fingerprint) != (tenant, namespace_fingerprint):
            raise PermissionDenied(f"the prefetch ticket is for tenant {ticket.prefetch_tenant!r} namespace "
                                   f"{ticket.prefetch_namespace_fingerprint}, not {tenant!r} {namespace_fingerprint}")
        if ticket.prefetch_blocks_sha256 != prefetch_blocks_digest(block_hashes):
            raise PermissionDenied("the prefetch ticket is for other blocks")
        return ticket

    def _open(self, token: bytes, kind, what: str):
        """The signed claims of ``kind`` in ``token``, every field type-checked, then the signature checked
        with the key it names."""
        payload, signature = _split(token, what)
        claims = _claims(kind, payload, what)
        signing_key = self._keys.get(claims.key_id)
        if signing_key is None:
            raise UnknownGrantKey(f"{what} signed by an unknown key ({claims.key_id[:40] or 'no key id'})")
        try:
            signing_key.verify(signature, payload)
        except (ValueError, InvalidSignature):
            raise PermissionDenied(f"invalid {what}") from None
        return claims
