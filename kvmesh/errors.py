"""Domain errors shared by every kvmesh core.

Cores raise these; the gRPC layer maps each to one status code in one place
(:mod:`kvmesh.grpc_errors`). Nothing else signals failure: no ``ok: bool``.
"""

from __future__ import annotations


class KvmeshError(Exception):
    """Base class. ``str(err)`` is the message a caller sees."""


class InvalidArgument(KvmeshError):
    """The request is malformed; retrying it unchanged cannot succeed."""


class NotFound(KvmeshError):
    """A named entity (node, tenant, key) does not exist."""


class FailedPrecondition(KvmeshError):
    """The caller's view is stale (old incarnation, expired lease): re-sync first."""


class AlreadyExists(KvmeshError):
    """Creating something that exists."""


class Unauthenticated(KvmeshError):
    """No credential, or one that is unknown, revoked or expired."""


class PermissionDenied(KvmeshError):
    """The credential is valid but may not do this."""


class ResourceExhausted(KvmeshError):
    """A quota or a capacity limit was reached; nothing was partially applied."""


class Unavailable(KvmeshError):
    """A dependency (Redis, a peer) is unreachable; retrying later may succeed."""


class DeadlineExceeded(KvmeshError):
    """A bounded wait ran out."""


def clipped(text: str, limit: int = 256) -> str:
    """``text`` as it goes into a message or an audit entry: cut to ``limit`` characters, saying how long it was
    (a caller's string is bounded only by the request size, 16 MiB, and would otherwise be echoed and stored whole)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
