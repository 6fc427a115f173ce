"""Who may call a data plane, and with what.

- Local callers (the node's own engine and tools) present the node's own API key.
- Peers (other data planes pulling from this one) present their own node key and
  a pull grant (``kvmesh-grant`` metadata) that the control plane signed for
  exactly that key, this source node, and the namespace asked about.

Peer keys cannot be checked here (the key store is the control plane's): a
grant binds the key's id and hash, so presenting another node's grant, an
expired or forged one, or one for another namespace or source, is refused.
What the control plane answers (tenant limits, pull grants) is cached with
negative caching and stale-while-revalidate (:class:`Answers`): a hung or
unreachable control plane costs each key at most one bounded wait per refresh
period, never one per call. Tenant limits fail open (the last known limit, or
none); grants fail closed (no grant, no pull: the engine recomputes).
Threading model: event-loop thread only.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

import grpc

from kvmesh.channels import ClientTLS, channel
from kvmesh.errors import PermissionDenied, Unavailable
from kvmesh.namespace import Namespace
from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from tenancy import api_keys
from tenancy.auth import current_principal, grant_from
from tenancy.grants import Grant, GrantVerifier
from tenancy.model import Principal, Role

log = logging.getLogger(__name__)

GRANT_REFRESH_MARGIN_MS = 5_000  # a grant closer than this to its expiry is renewed (in the background)
GRANT_MIN_LIFE_MS = 1_000  # a grant closer than this to its expiry is not handed out

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True)
class _Entry(Generic[V]):
    answer: V | PermissionDenied | None = None  # the last answer (a refusal is an answer too)
    answered_at: float | None = None
    failed_at: float | None = None  # when the last fetch failed or timed out
    fetch: asyncio.Task | None = None  # the one fetch in flight for this key


class Answers(Generic[K, V]):
    """Control-plane answers per key, fetched at most once at a time per key.

    * fresh (``is_fresh``): returned as is;
    * stale but usable (``is_usable``): returned at once while one background fetch revalidates;
    * none usable: the caller waits for the fetch, at most ``timeout_s`` (and its own bound);
    * a failed or timed-out fetch is remembered for ``refresh_s``: until then no caller waits again
      for this key, stale answers keep being served, and callers without one get Unavailable.
    """

    def __init__(self, fetch: Callable[[K, float], Awaitable[V]], *, timeout_s: float, refresh_s: float,
                 is_fresh: Callable[[V, float], bool], is_usable: Callable[[V], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._timeout_s = timeout_s
        self._refresh_s = refresh_s
        self._is_fresh = is_fresh  # (answer, its age in s)
        self._is_usable = is_usable
        self._clock = clock
        self._entries: dict[K, _Entry[V]] = {}

    async def get(self, key: K, timeout_s: float) -> V:
        """The answer for ``key``; PermissionDenied if that was the answer, Unavailable if there is none."""
        entry = self._entries.setdefault(key, _Entry())
        now = self._clock()
        backing_off = entry.failed_at is not None and now - entry.failed_at < self._refresh_s
        usable = entry.answered_at is not None and (
            isinstance(entry.answer, PermissionDenied) or self._is_usable(entry.answer))
        if usable:
            age = now - entry.answered_at
            fresh = age < self._refresh_s if isinstance(entry.answer, PermissionDenied) else \
                self._is_fresh(entry.answer, age)
            if not fresh and not backing_off:
                self._start(key, entry)
            return self._unwrap(entry.answer)
        if backing_off:
            raise Unavailable(f"control plane unavailable (last try {now - entry.failed_at:.1f}s ago)")
        task = self._start(key, entry)
        try:
            answered = await asyncio.wait_for(asyncio.shield(task), max(0.0, min(timeout_s, self._timeout_s)))
        except TimeoutError:
            raise Unavailable("control plane did not answer in time") from None
        if not answered:
            raise Unavailable("control plane unavailable")
        return self._unwrap(entry.answer)

    def _start(self, key: K, entry: _Entry[V]) -> asyncio.Task:
        if entry.fetch is None:
            entry.fetch = asyncio.get_running_loop().create_task(self._refresh(key, entry))
        return entry.fetch

    async def _refresh(self, key: K, entry: _Entry[V]) -> bool:
        try:
            answer = await asyncio.wait_for(self._fetch(key, self._timeout_s), self._timeout_s)
        except PermissionDenied as exc:
            answer = exc
        except (Unavailable, TimeoutError) as exc:
            log.warning("control plane: no answer for %s (%s); retrying in %.0fs", key, exc or "timeout",
                        self._refresh_s)
            entry.failed_at = self._clock()
            return False
        finally:
            entry.fetch = None
        entry.answer, entry.answered_at, entry.failed_at = answer, self._clock(), None
        return True

    @staticmethod
    def _unwrap(answer):
        if isinstance(answer, PermissionDenied):
            raise answer
        return answer


class NodeAuth:
    def __init__(self, node_id: str, node_key: str, grant_public_key: str, control_plane_address: str, *,
                 timeout_s: float = 2.0, refresh_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, tls: ClientTLS | None = None) -> None:
        """``timeout_s``: the longest wait for one control-plane call; ``refresh_s``: how long tenant limits
        stay fresh and how long a failed call is not retried; ``tls``: how to reach the control plane
        (None: plaintext)."""
        self.node_id = node_id
        self._tls = tls
        self.node_key = node_key
        self._key_id, secret = api_keys.parse(node_key)
        self._key_hash = api_keys.hash_secret(secret)
        self._cp_address = control_plane_address
        self._verifier = GrantVerifier(base64.b64decode(grant_public_key), node_id) if grant_public_key else None
        self._timeout_s = timeout_s
        self._grants: Answers[tuple[Namespace, str], tuple[bytes, int]] = Answers(
            self._issue_grant, timeout_s=timeout_s, refresh_s=refresh_s, clock=clock,
            is_fresh=lambda grant, _age: grant[1] - GRANT_REFRESH_MARGIN_MS > time.time() * 1000,
            is_usable=lambda grant: grant[1] - GRANT_MIN_LIFE_MS > time.time() * 1000)
        self._grant_key: Answers[str, bytes] = Answers(
            self._fetch_grant_key, timeout_s=timeout_s, refresh_s=refresh_s, clock=clock,
            is_fresh=lambda _key, _age: True, is_usable=lambda _key: True)
        self._limits: Answers[str, int | None] = Answers(
            self._fetch_limit, timeout_s=timeout_s, refresh_s=refresh_s, clock=clock,
            is_fresh=lambda _limit, age: age < refresh_s, is_usable=lambda _limit: True)

    async def authenticate(self, presented: str) -> Principal:
        key_id, secret = api_keys.parse(presented)
        key_hash = api_keys.hash_secret(secret)
        own = key_id == self._key_id and hmac.compare_digest(key_hash, self._key_hash)
        return Principal(key_id, Role.NODE, node_id=self.node_id if own else "", secret_hash=key_hash)

    def is_local(self, principal: Principal) -> bool:
        return principal.node_id == self.node_id

    def require_local(self, what: str) -> None:
        if not self.is_local(current_principal()):
            raise PermissionDenied(f"{what} is this node's local API: present the node's own key")

    async def require_grant(self, metadata, ns: Namespace | None) -> Grant | None:
        """Local callers pass; a peer needs a valid grant for ``ns`` (None: for any namespace)."""
        principal = current_principal()
        if self.is_local(principal):
            return None
        verifier = await self._grant_verifier()
        return verifier.verify(grant_from(metadata), key_id=principal.key_id, key_hash=principal.secret_hash,
                               namespace_fingerprint=ns.fingerprint if ns is not None else None)

    async def _grant_verifier(self) -> GrantVerifier:
        if self._verifier is None:
            if not self._cp_address:
                raise PermissionDenied("this node cannot verify pull grants: configure grant_public_key or "
                                       "control_plane_address")
            key = await self._grant_key.get("grant key", self._timeout_s)
            self._verifier = GrantVerifier(key, self.node_id)
        return self._verifier

    async def _fetch_grant_key(self, _key: str, timeout_s: float) -> bytes:
        reply = await self._call(lambda stub: stub.GetGrantKey(cp_pb.GetGrantKeyRequest(), timeout=timeout_s))
        return reply.ed25519_public_key

    async def grant_for(self, ns: Namespace, source_node_id: str, timeout_s: float = 5.0) -> bytes:
        """A grant for this node to pull ``ns`` from ``source_node_id``, from the control plane (cached,
        renewed before it expires). Fails closed: PermissionDenied when refused, Unavailable when the
        control plane does not answer within ``timeout_s`` (or failed within the refresh period)."""
        if not self._cp_address:
            raise PermissionDenied("no pull grant: pass PullRequest.grant or configure control_plane_address")
        token, _ = await self._grants.get((ns, source_node_id), timeout_s)
        return token

    async def _issue_grant(self, key: tuple[Namespace, str], timeout_s: float) -> tuple[bytes, int]:
        ns, source_node_id = key
        request = cp_pb.IssuePullGrantRequest(namespace=ns.to_proto(), source_node_id=source_node_id)
        reply = await self._call(lambda stub: stub.IssuePullGrant(request, timeout=timeout_s))
        return reply.token, reply.expires_unix_ms

    async def tenant_limit(self, tenant: str, timeout_s: float = 5.0) -> int | None:
        """CPU-tier bytes this node may hold for ``tenant`` (None: no limit), from the control plane,
        cached. PermissionDenied: the tenant's policy does not allow this node. Without a control plane
        no tenant policy is enforced here. Fails open: while the control plane does not answer, the last
        known limit applies, or none (waiting at most ``timeout_s`` once per refresh period)."""
        if not self._cp_address:
            return None
        try:
            return await self._limits.get(tenant, timeout_s)
        except Unavailable:
            return None

    async def _fetch_limit(self, tenant: str, timeout_s: float) -> int | None:
        request = cp_pb.GetTenantLimitsRequest(tenant=tenant)
        reply = await self._call(lambda stub: stub.GetTenantLimits(request, timeout=timeout_s))
        return reply.max_cpu_tier_bytes_per_node or None

    async def _call(self, rpc):
        try:
            async with channel(self._cp_address, self.node_key, self._tls) as ch:
                return await rpc(cp_grpc.ControlPlaneStub(ch))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDenied(f"control plane refused: {exc.details()}") from None
            raise Unavailable(f"control plane unavailable: {exc.code().name} {exc.details()}") from None
