"""Authentication of every RPC: a gRPC server interceptor and the current principal.

Clients send ``authorization: Bearer kvm_<key_id>_<secret>``. The interceptor
resolves the key to a :class:`Principal` (key records come through
:class:`tenancy.key_cache.KeyCache`: revocations are pushed, so a revoked key
fails on its next call, within a stated bound), makes it available to the
handler through :func:`current_principal` and answers UNAUTHENTICATED
otherwise. On a client-streaming RPC the key is checked again before each
message, so a key revoked while its stream is open is refused at the next
message. Health checks and reflection are exempt so orchestrators can probe
liveness (they reveal no tenant data).
"""

from __future__ import annotations

import contextvars
import functools
import hmac
import logging
import time
from typing import Awaitable, Callable

import grpc

from kvmesh.errors import Unauthenticated
from kvmesh.grpc_server import rewrap_handler
from kvmesh.request_gate import client_streaming
from tenancy import api_keys
from tenancy.model import AuditEntry, Principal, Role

log = logging.getLogger(__name__)

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
BOOTSTRAP_KEY_ID = "bootstrap"

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("kvmesh_principal", default=None)

KeyLookup = Callable[[str], Awaitable["object | None"]]
AuditSink = Callable[[AuditEntry], Awaitable[None]]


def current_principal() -> Principal:
    principal = _principal.get()
    if principal is None:
        raise Unauthenticated("no credentials")
    return principal


def call_owner(context) -> str | None:
    """Who a call in flight counts against (kvmesh.grpc_server.InFlightLimit) where every key is verified (the
    control plane): its key. None outside an authenticated call."""
    principal = _principal.get()
    return principal.key_id if principal is not None else None


def peer_host(context) -> str:
    """The host a call came from (``ipv4:10.0.0.7`` of ``ipv4:10.0.0.7:53122``)."""
    return (context.peer() or "").rsplit(":", 1)[0]


def peer_identity(context) -> str:
    """Who a call came from, as far as the connection proves it: the common name of its client certificate where
    the server requires one (mutual TLS: the server's CA verified it at the handshake, so it cannot be made up),
    else its host. Peers on one host (``kvmesh up``), or behind one NAT address, are told apart by certificate."""
    names = (context.auth_context() or {}).get("x509_common_name")
    return f"cert:{names[0].decode(errors='replace')}" if names else f"host:{peer_host(context)}"


def bearer(metadata) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode() if isinstance(value, bytes) else value
            if value.startswith("Bearer "):
                return value[len("Bearer "):].strip()
            raise Unauthenticated("authorization metadata must be 'Bearer <key>'")
    raise Unauthenticated("missing credentials: send 'authorization: Bearer <key>' metadata")


def auth_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``key``."""
    return (("authorization", f"Bearer {key}"),)


GRANT_METADATA = "kvmesh-grant"


def grant_metadata(token: bytes) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a pull grant (see tenancy.grants)."""
    return ((GRANT_METADATA, token.decode()),)


def grant_from(metadata) -> bytes:
    for key, value in metadata or ():
        if key == GRANT_METADATA:
            return value.encode() if isinstance(value, str) else value
    return b""


class Authenticator:
    """Resolves presented keys: the bootstrap admin key, or a stored, unrevoked key."""

    def __init__(self, get_key: KeyLookup, bootstrap_admin_key: str | None = None) -> None:
        self._get_key = get_key
        self._bootstrap_hash = None
        if bootstrap_admin_key:
            _, secret = api_keys.parse(bootstrap_admin_key)
            self._bootstrap_hash = api_keys.hash_secret(secret)
            self._bootstrap_id = bootstrap_admin_key[len(api_keys.PREFIX):].split("_", 1)[0]

    async def authenticate(self, presented: str) -> Principal:
        key_id, secret = api_keys.parse(presented)
        if self._bootstrap_hash and key_id == self._bootstrap_id:
            if hmac.compare_digest(api_keys.hash_secret(secret), self._bootstrap_hash):
                return Principal(BOOTSTRAP_KEY_ID, Role.ADMIN, secret_hash=self._bootstrap_hash)
            raise Unauthenticated("invalid API key")
        key = await self._get_key(key_id)
        if key is None or not api_keys.matches(secret, key.secret_hash):
            raise Unauthenticated("invalid API key")
        if key.revoked:
            raise Unauthenticated("API key revoked")
        return Principal.from_key(key)


def _with_principal(principal: Principal, recheck=None):
    """Runs the handler as ``principal``; ``recheck`` (client-streaming calls) wraps the request stream."""
    def wrap(behavior, streaming: bool):
        if streaming:
            async def stream(request, context):
                _principal.set(principal)
                async for item in behavior(recheck(request, context) if recheck else request, context):
                    yield item

            return stream

        async def unary(request, context):
            _principal.set(principal)
            return await behavior(recheck(request, context) if recheck else request, context)

        return unary

    return wrap


def _denial(code: grpc.StatusCode, message: str):
    def wrap(behavior, streaming: bool):
        async def abort(request, context):
            await context.abort(code, message)

        async def abort_stream(request, context):  # a streaming handler must be an async generator
            await context.abort(code, message)
            yield  # never reached: abort raises

        return abort_stream if streaming else abort

    return wrap


Authenticate = Callable[[str], Awaitable[Principal]]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every non-exempt RPC with ``authenticate`` (presented key -> principal, or
    Unauthenticated); denials are audited when a sink is given."""

    def __init__(self, authenticate: Authenticate, audit: AuditSink | None = None,
                 peer: Callable[[grpc.HandlerCallDetails], Principal | None] | None = None) -> None:
        """``peer``: for calls without a bearer key, the principal of a call that another credential the handler
        itself checks authenticates (a peer's proof, a prefetch ticket: data planes only), or None."""
        self._authenticate = authenticate
        self._audit = audit
        self._peer = peer

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        try:
            try:
                principal = await self._authenticate(bearer(details.invocation_metadata))
            except Unauthenticated:
                principal = self._peer(details) if self._peer is not None else None
                if principal is None:
                    raise
        except Unauthenticated as exc:
            await self.record_denial("-", details.method, "UNAUTHENTICATED", str(exc))
            return rewrap_handler(handler, _denial(grpc.StatusCode.UNAUTHENTICATED, str(exc)))
        except Exception:  # noqa: BLE001 - the key store is down: fail closed, and say so
            log.warning("could not check credentials", exc_info=True)
            return rewrap_handler(handler, _denial(grpc.StatusCode.UNAVAILABLE, "credential store unavailable"))
        recheck = None
        if client_streaming(details.method):
            recheck = functools.partial(self._rechecked, bearer(details.invocation_metadata))
        return rewrap_handler(handler, _with_principal(principal, recheck))

    async def _rechecked(self, presented: str, requests, context):
        """The request stream, with the caller's key checked again before each message."""
        async for message in requests:
            try:
                await self._authenticate(presented)
            except Unauthenticated as exc:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{exc} (stream closed)")
            except Exception:  # noqa: BLE001 - the key store is down: fail closed
                log.warning("could not check credentials", exc_info=True)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "credential store unavailable")
            yield message

    async def record_denial(self, actor: str, method: str, outcome: str, detail: str) -> None:
        if self._audit is None:
            return
        try:
            await self._audit(AuditEntry(int(time.time() * 1000), actor, f"denied:{method.rsplit('/', 1)[-1]}",
                                         method, outcome, detail))
        except Exception:  # noqa: BLE001 - auditing must not turn a denial into a crash
            log.warning("could not audit a denial", exc_info=True)
