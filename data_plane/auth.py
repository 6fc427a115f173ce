"""Who may call a data plane, and with what.

- Local callers (the node's own engine and tools) present the node's own API key.
- Peers (other data planes pulling from this one) present no API key (a node's
  key is used with the control plane only): a pull grant (``kvmesh-grant``
  metadata) that the control plane signed for this source node, the namespace
  asked about and the consumer's peer public key, plus a proof of possession of
  that key made for this node, call and request (``kvmesh-proof``,
  tenancy.peer_proof). Another node's grant, an expired, forged or malformed
  one, one for another namespace or source, or a proof replayed here later,
  made for another node or for a request with other fields, is refused.
What the control plane answers (tenant limits, pull grants) is cached with
negative caching and stale-while-revalidate (:class:`Answers`): a hung or
unreachable control plane costs each key at most one bounded wait per refresh
period, never one per call. Tenant limits fail open (the last known limit, or
none); grants fail closed (no grant, no pull: the engine recomputes). The
limits answer carries the tenant's epoch (NOT_FOUND: the tenant was deleted, or
its policy no longer allows this node),
handed to the core (:meth:`NodeAuth.watch_epochs`, data_plane.epochs); a
changed epoch also drops the tenant's cached grants. While the control plane
does not answer, the last known epoch stays in force (fail open, as limits).
Threading model: event-loop thread only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

import grpc

from kvmesh.channels import ClientTLS, channel
from kvmesh.errors import KvmeshError, NotFound, PermissionDenied, Unauthenticated, Unavailable
from kvmesh.namespace import Namespace
from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from tenancy import api_keys
from tenancy.auth import current_principal, grant_from, peer_identity
from tenancy.grants import Grant, GrantVerifier, PrefetchTicket, UnknownGrantKey
from tenancy.model import Principal, Role
from tenancy.peer_proof import PROOF_METADATA, NodeIdentity, NonceCache, PeerCall, ProofVerifier

from data_plane.epochs import GONE, Epoch

log = logging.getLogger(__name__)

PREFETCH_METHOD = "/kvmesh.v1.DataPlane/Prefetch"
KEY_RECHECK_S = 5.0  # how often a refused node key is put to the control plane again
PEER = Principal("peer", Role.NODE)  # a call that authenticates by a grant and its proof, not by a key

GRANT_REFRESH_MARGIN_MS = 5_000  # a grant closer than this to its expiry is renewed (in the background)
GRANT_MIN_LIFE_MS = 1_000  # a grant closer than this to its expiry is not handed out
GRANT_KEYS_MIN_REFRESH_S = 5.0  # a grant under an unknown key id refreshes the keys at most this often
USED_TICKET_SLACK_MS = 1_000  # a used prefetch ticket is remembered this long past its expiry (none passes later)
MAX_LIVE_TICKETS = 65_536  # used, unexpired prefetch tickets held; more at once are refused (ResourceExhausted)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class TenantAnswer:
    """The control plane's GetTenantLimits answer for this node."""

    limit: int | None  # CPU-tier bytes this node may hold for the tenant (None: no limit)
    epoch: Epoch  # GONE: the tenant does not exist


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

    async def refresh(self, key: K, timeout_s: float) -> None:
        """Fetches ``key`` now (or joins the fetch in flight), waiting at most ``timeout_s``; nothing while
        a failed fetch is within its back-off."""
        entry = self._entries.setdefault(key, _Entry())
        if entry.failed_at is not None and self._clock() - entry.failed_at < self._refresh_s:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._start(key, entry)), max(0.0, min(timeout_s, self._timeout_s)))
        except TimeoutError:
            pass

    def forget(self, keys: Callable[[K], bool]) -> None:
        """Drops the answers for the keys ``keys`` selects (the next call fetches again)."""
        for key in [k for k in self._entries if keys(k)]:
            del self._entries[key]

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
                 timeout_s: float = 2.0, refresh_s: float = 10.0, grant_keys_refresh_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, tls: ClientTLS | None = None) -> None:
        """``timeout_s``: the longest wait for one control-plane call; ``refresh_s``: how long tenant limits
        stay fresh and how long a failed call is not retried; ``grant_keys_refresh_s``: how often the
        accepted grant keys are fetched again (GetGrantKeys); ``tls``: how to reach the control plane
        (None: plaintext)."""
        self.node_id = node_id
        self._tls = tls
        self.node_key = node_key
        self._key_id, secret = api_keys.parse(node_key)
        self._key_hash = api_keys.hash_secret(secret)
        self._cp_address = control_plane_address
        self._verifier = GrantVerifier(base64.b64decode(grant_public_key), node_id) if grant_public_key else None
        self._timeout_s = timeout_s
        self.identity = NodeIdentity()  # this process's peer key pair: bound into its grants
        self._proofs = ProofVerifier(node_id)
        # prefetch tickets taken, each until it expires: a ticket starts one prefetch, never a second
        self._used_tickets = NonceCache(USED_TICKET_SLACK_MS, MAX_LIVE_TICKETS, what="prefetch tickets")
        # A configured key is final; keys from the control plane are refreshed every grant_keys_refresh_s.
        self._static_keys = bool(grant_public_key)
        self._forced_at = -float("inf")
        self._grants: Answers[tuple[Namespace, str], tuple[bytes, int, str]] = Answers(
            self._issue_grant, timeout_s=timeout_s, refresh_s=refresh_s, clock=clock,
            is_fresh=lambda grant, _age: grant[1] - GRANT_REFRESH_MARGIN_MS > time.time() * 1000,
            is_usable=lambda grant: grant[1] - GRANT_MIN_LIFE_MS > time.time() * 1000)
        self._grant_keys: Answers[str, list[bytes]] = Answers(
            self._fetch_grant_keys, timeout_s=timeout_s, refresh_s=refresh_s, clock=clock,
            is_fresh=lambda _keys, age: age < grant_keys_refresh_s, is_usable=lambda _keys: True)
        self._limits: Answers[str, TenantAnswer] = Answers(
            self._fetch_limit, timeout_s=timeout_s, refresh_s=refresh_s, clock=clock,
            is_fresh=lambda _limit, age: age < refresh_s, is_usable=lambda _limit: True)
        self._epochs: dict[str, Epoch] = {}  # the last epoch the control plane answered, per tenant
        self._on_epoch: Callable[[str, Epoch], None] = lambda _tenant, _epoch: None
        # the control plane's last UNAUTHENTICATED to this node's key ("" while it takes it): a revoked node key
        # no longer opens this node's local API, whoever holds it
        self._key_refused = ""
        self._key_rechecked_at = -float("inf")
        self._recheck: asyncio.Future | None = None
        self._channel: tuple[asyncio.AbstractEventLoop, grpc.aio.Channel] | None = None

    async def authenticate(self, presented: str) -> Principal:
        key_id, secret = api_keys.parse(presented)
        key_hash = api_keys.hash_secret(secret)
        own = key_id == self._key_id and hmac.compare_digest(key_hash, self._key_hash)
        if own and self._key_refused:
            self._recheck_key()
            raise Unauthenticated(f"the control plane refuses this node's key ({self._key_refused}): give the "
                                  "data plane a new key (api_key) and restart it")
        return Principal(key_id, Role.NODE, node_id=self.node_id if own else "", secret_hash=key_hash)

    def _recheck_key(self) -> None:
        """Asks the control plane again, in the background and at most every KEY_RECHECK_S, whether it takes
        this node's key (a control plane that refused it for another reason, e.g. pointed at the wrong Redis)."""
        now = time.monotonic()
        if now - self._key_rechecked_at < KEY_RECHECK_S:
            return
        self._key_rechecked_at = now

        async def ask() -> None:
            with contextlib.suppress(KvmeshError):
                await self._call(lambda stub: stub.GetGrantKeys(cp_pb.GetGrantKeysRequest(), timeout=self._timeout_s))
        self._recheck = asyncio.ensure_future(ask())

    def call_owner(self, context) -> str | None:
        """Who a call in flight counts against (kvmesh.grpc_server.InFlightLimit): the node's own key (its
        engines); any other caller by its client certificate (mutual TLS), else its host. Only the own key is
        verified here: a peer proves itself per call (grant and proof, checked by the handler) and any other key is
        taken as presented, so counting by key would give a caller who makes keys up a fresh budget per key."""
        principal = current_principal()
        return principal.key_id if self.is_local(principal) else f"peer@{peer_identity(context)}"

    def is_local(self, principal: Principal) -> bool:
        return principal.node_id == self.node_id

    def require_local(self, what: str) -> None:
        if not self.is_local(current_principal()):
            raise PermissionDenied(f"{what} is this node's local API: present the node's own key")

    def peer_principal(self, details: grpc.HandlerCallDetails) -> Principal | None:
        """A call without an API key is a peer's when it carries a proof (checked in :meth:`require_grant`), or
        when it is a Prefetch (its ticket, checked in :meth:`check_prefetch`, is the authority: a scheduler hands
        the order over without its own key, which this node could otherwise keep and use)."""
        if details.method == PREFETCH_METHOD:
            return PEER
        return PEER if any(key == PROOF_METADATA for key, _ in details.invocation_metadata or ()) else None

    async def require_grant(self, metadata, ns: Namespace | None, call: PeerCall) -> Grant | None:
        """Local callers pass; a peer needs a valid grant for ``ns`` (None: for any namespace) and a proof
        that it holds the grant's consumer key, made for this node and ``call`` (the method and the digest
        of the request it came with) just now (never an API key: peers present none)."""
        principal = current_principal()
        if self.is_local(principal):
            return None
        token = grant_from(metadata)
        fingerprint = ns.fingerprint if ns is not None else None
        verifier = await self._grant_verifier()
        try:
            grant = verifier.verify(token, namespace_fingerprint=fingerprint)
        except UnknownGrantKey:  # signed by a key newer than the last refresh, or by nobody we trust
            if not await self._refresh_grant_keys(GRANT_KEYS_MIN_REFRESH_S):
                raise
            grant = self._verifier.verify(token, namespace_fingerprint=fingerprint)
        proof = next((v for k, v in metadata or () if k == PROOF_METADATA), "")
        self._proofs.verify(token, grant.consumer_public_key, proof, call)
        return grant

    async def check_route(self, token: bytes, tenant: str, source_node_id: str, source_address: str) -> None:
        """PermissionDenied unless ``token`` is Route's signature on this source for ``tenant``
        (require_route_token)."""
        verifier = await self._grant_verifier()
        where = dict(tenant=tenant, source_node_id=source_node_id, source_address=source_address)
        try:
            verifier.verify_route(token, **where)
        except UnknownGrantKey:
            if not await self._refresh_grant_keys(GRANT_KEYS_MIN_REFRESH_S):
                raise
            self._verifier.verify_route(token, **where)

    async def check_prefetch(self, token: bytes, ns: Namespace, block_hashes: list[bytes]) -> PrefetchTicket:
        """The ticket of a Route's PrefetchOrder for this node, ``ns`` and these blocks, presented for the first
        time (PermissionDenied otherwise: a ticket is used once, whoever presents it again)."""
        verifier = await self._grant_verifier()
        what = dict(namespace_fingerprint=ns.fingerprint, tenant=ns.tenant, block_hashes=block_hashes)
        try:
            ticket = verifier.verify_prefetch(token, **what)
        except UnknownGrantKey:
            if not await self._refresh_grant_keys(GRANT_KEYS_MIN_REFRESH_S):
                raise
            ticket = self._verifier.verify_prefetch(token, **what)
        seen = int.from_bytes(hashlib.sha256(token).digest()[:8], "big")
        if not self._used_tickets.add(seen, ticket.expires_unix_ms, int(time.time() * 1000)):
            raise PermissionDenied("this prefetch ticket was already used (a ticket starts one prefetch): "
                                   "Route again for a new order")
        return ticket

    def peer_proof(self, grant: bytes, call: PeerCall, target_node_id: str) -> str:
        """This node's proof for a peer ``call`` to ``target_node_id`` under ``grant``."""
        return self.identity.proof(grant, call, target_node_id)

    async def _grant_verifier(self) -> GrantVerifier:
        """The verifier of pull grants: a configured key, or the control plane's accepted keys, refreshed
        every grant_keys_refresh_s (served stale while revalidated; a rotation's overlap reaches this node
        within that period)."""
        if self._static_keys:
            return self._verifier
        if not self._cp_address:
            raise PermissionDenied("this node cannot verify pull grants: configure grant_public_key or "
                                   "control_plane_address")
        try:
            self._use_keys(await self._grant_keys.get("grant keys", self._timeout_s))
        except Unavailable:
            if self._verifier is None:
                raise PermissionDenied("cannot verify pull grants: the control plane is unreachable") from None
        return self._verifier

    def _use_keys(self, keys: list[bytes]) -> None:
        if self._verifier is None:
            self._verifier = GrantVerifier(keys, self.node_id)
        else:
            self._verifier.set_keys(keys)

    async def _fetch_grant_keys(self, _key: str, timeout_s: float) -> list[bytes]:
        reply = await self._call(lambda stub: stub.GetGrantKeys(cp_pb.GetGrantKeysRequest(), timeout=timeout_s))
        return [k.ed25519_public_key for k in reply.keys]

    async def _refresh_grant_keys(self, min_age_s: float) -> bool:
        """Fetches the accepted grant keys now (a grant named a key id this node does not know), unless
        that was done within ``min_age_s`` or the keys are configured; True if fetched."""
        now = time.monotonic()
        if not self._cp_address or self._static_keys or now - self._forced_at < min_age_s:
            return False
        self._forced_at = now
        # through the cache, so the next _grant_verifier() does not put the keys it held before back
        await self._grant_keys.refresh("grant keys", self._timeout_s)
        try:
            self._use_keys(await self._grant_keys.get("grant keys", self._timeout_s))
        except Unavailable:
            return False
        return True

    async def grant_for(self, ns: Namespace, source_node_id: str, timeout_s: float = 5.0) -> tuple[bytes, str]:
        """A grant for this node to pull ``ns`` from ``source_node_id``, from the control plane (cached,
        renewed before it expires), and the source's registered address. Fails closed: PermissionDenied
        when refused, Unavailable when the control plane does not answer within ``timeout_s`` (or failed
        within the refresh period)."""
        if not self._cp_address:
            raise PermissionDenied("no pull grant: pass PullRequest.grant or configure control_plane_address")
        token, _, address = await self._grants.get((ns, source_node_id), timeout_s)
        return token, address

    async def _issue_grant(self, key: tuple[Namespace, str], timeout_s: float) -> tuple[bytes, int, str]:
        ns, source_node_id = key
        request = cp_pb.IssuePullGrantRequest(namespace=ns.to_proto(), source_node_id=source_node_id,
                                              consumer_public_key=self.identity.public_key)
        reply = await self._call(lambda stub: stub.IssuePullGrant(request, timeout=timeout_s))
        return reply.token, reply.expires_unix_ms, reply.source_address

    async def tenant_limit(self, tenant: str, timeout_s: float = 5.0) -> int | None:
        """CPU-tier bytes this node may hold for ``tenant`` (None: no limit), from the control plane,
        cached. PermissionDenied: the tenant does not exist or its policy does not allow this node (the
        control plane answers both NOT_FOUND, and this node drops the tenant's blocks). Without a control
        plane no tenant policy is enforced here. Fails open: while the control plane does not answer, the
        last known limit applies, or none (waiting at most ``timeout_s`` once per refresh period)."""
        if not self._cp_address:
            return None
        try:
            answer = await self._limits.get(tenant, timeout_s)
        except Unavailable:
            return None
        if answer.epoch is GONE:
            raise PermissionDenied(f"tenant {tenant!r} does not exist or does not allow node {self.node_id!r} "
                                   "to hold its blocks")
        return answer.limit

    def watch_epochs(self, on_epoch: Callable[[str, Epoch], None]) -> None:
        """``on_epoch(tenant, epoch)`` runs on every answer of the control plane about a tenant's epoch."""
        self._on_epoch = on_epoch

    async def refresh_tenant(self, tenant: str, timeout_s: float) -> None:
        """Asks the control plane for the tenant's limits and epoch now (bounded; errors are logged by the
        cache and the last answer stays)."""
        if self._cp_address:
            await self._limits.refresh(tenant, timeout_s)

    async def _fetch_limit(self, tenant: str, timeout_s: float) -> TenantAnswer:
        request = cp_pb.GetTenantLimitsRequest(tenant=tenant)
        try:
            reply = await self._call(lambda stub: stub.GetTenantLimits(request, timeout=timeout_s))
            answer = TenantAnswer(reply.max_cpu_tier_bytes_per_node or None, reply.tenant_epoch)
        except NotFound:
            answer = TenantAnswer(None, GONE)
        if self._epochs.get(tenant, answer.epoch) != answer.epoch:  # re-created or deleted: no old grant
            self._grants.forget(lambda key: key[0].tenant == tenant)
        self._epochs[tenant] = answer.epoch
        self._on_epoch(tenant, answer.epoch)
        return answer

    def _stub(self) -> cp_grpc.ControlPlaneStub:
        """One channel to the control plane for this node's calls (opened on first use, per event loop:
        a new connection and TLS handshake per grant or limits fetch would cost more than the call)."""
        loop = asyncio.get_running_loop()
        if self._channel is None or self._channel[0] is not loop:
            self._channel = (loop, channel(self._cp_address, self.node_key, self._tls))
        return cp_grpc.ControlPlaneStub(self._channel[1])

    async def close(self) -> None:
        if self._channel is not None:
            _, ch = self._channel
            self._channel = None
            await ch.close()

    async def _call(self, rpc):
        try:
            reply = await rpc(self._stub())
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # this node's key is revoked (or unknown there)
                if not self._key_refused:
                    log.warning("the control plane refuses node %s's key (%s): its local API is closed to it until "
                                "the control plane takes it again", self.node_id, exc.details())
                self._key_refused = exc.details() or "UNAUTHENTICATED"
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDenied(f"control plane refused: {exc.details()}") from None
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"control plane: {exc.details()}") from None
            raise Unavailable(f"control plane unavailable: {exc.code().name} {exc.details()}") from None
        if self._key_refused:
            log.warning("the control plane takes node %s's key again", self.node_id)
            self._key_refused = ""
        return reply
