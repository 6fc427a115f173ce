"""API key format and hashing.

A key is ``kvm_<key_id>_<secret>``: ``key_id`` (12 hex) names the stored
record, ``secret`` (43 url-safe chars, 256 random bits) is never stored: only
its SHA-256 is. A salted slow hash is unnecessary for 256-bit random secrets.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets as _secrets  # the standard library module
from pathlib import Path

from kvmesh.errors import Unauthenticated

PREFIX = "kvm_"


def new_key() -> tuple[str, str, str]:
    """Returns (key_id, the full key to hand out once, its hash to store)."""
    key_id = _secrets.token_hex(6)
    secret = _secrets.token_urlsafe(32)
    return key_id, f"{PREFIX}{key_id}_{secret}", hash_secret(secret)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse(key: str) -> tuple[str, str]:
    """Splits a presented key into (key_id, secret); Unauthenticated when malformed."""
    if not key.startswith(PREFIX) or key.count("_") < 2:
        raise Unauthenticated("malformed API key: expected kvm_<key_id>_<secret>")
    key_id, secret = key[len(PREFIX):].split("_", 1)
    if len(key_id) != 12 or not secret:
        raise Unauthenticated("malformed API key: expected kvm_<key_id>_<secret>")
    return key_id, secret


def matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def from_setting(key: str | None, key_file: str | None) -> str | None:
    """A secret given inline, else read from a file (settings offer both); None when neither is set."""
    if key:
        return key.strip()
    if key_file:
        return Path(key_file).read_text().strip()
    return None


def key_from_setting(key: str | None, key_file: str | None) -> str | None:
    """An API key given inline, else read from a file; None when neither is set. ValueError naming the file (or
    the inline key) when it holds what no key holds: gRPC would refuse to send it, with a log line and an
    internal error, not a reason."""
    if key:
        return checked(key.strip(), "the API key given")
    if key_file:
        try:
            text = Path(key_file).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{key_file} is not text: an API key file holds one key, kvm_<key_id>_<secret>") from None
        return checked(text.strip(), key_file) or None
    return None


def checked(key: str, where: str) -> str:
    """``key`` if it is printable ASCII with no space (what any key, well-formed or not, must be to travel in a
    header); ValueError naming ``where`` otherwise."""
    if key.isascii() and key.isprintable() and " " not in key:
        return key
    raise ValueError(f"{where} holds characters no API key has (one line kvm_<key_id>_<secret>, printable ASCII): "
                     f"write the key an admin issued into it")
