"""Who may call a data plane, and with what.

- Local callers (the node's own engine and tools) present the node's own API key.
- Peers (other data planes pulling from this one) present their own node key and
  a pull grant (``kvmesh-grant`` metadata) that the control plane signed for
  exactly that key, this source node, and the namespace asked about.

Peer keys cannot be checked here (the key store is the control plane's): a
grant binds the key's id and hash, so presenting another node's grant, an
expired or forged one, or one for another namespace or source, is refused.
Threading model: event-loop thread only.
"""

from __future__ import annotations

import base64
import hmac
import time

import grpc

from kvmesh.channels import channel
from kvmesh.errors import PermissionDenied, Unavailable
from kvmesh.namespace import Namespace
from kvmesh.v1 import control_plane_pb2 as cp_pb, control_plane_pb2_grpc as cp_grpc
from tenancy import api_keys
from tenancy.auth import current_principal, grant_from
from tenancy.grants import Grant, GrantVerifier
from tenancy.model import Principal, Role

GRANT_REFRESH_MARGIN_MS = 5_000
LIMITS_TTL_S = 10.0


class NodeAuth:
    def __init__(self, node_id: str, node_key: str, grant_public_key: str, control_plane_address: str) -> None:
        self.node_id = node_id
        self.node_key = node_key
        self._key_id, secret = api_keys.parse(node_key)
        self._key_hash = api_keys.hash_secret(secret)
        self._cp_address = control_plane_address
        self._verifier = GrantVerifier(base64.b64decode(grant_public_key), node_id) if grant_public_key else None
        self._grants: dict[tuple[str, str], tuple[bytes, int]] = {}
        self._limits: dict[str, tuple[float, int | None]] = {}

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
            reply = await self._call(lambda stub: stub.GetGrantKey(cp_pb.GetGrantKeyRequest(), timeout=5.0))
            self._verifier = GrantVerifier(reply.ed25519_public_key, self.node_id)
        return self._verifier

    async def grant_for(self, ns: Namespace, source_node_id: str) -> bytes:
        """A grant for this node to pull ``ns`` from ``source_node_id``, from the control plane (cached)."""
        key = (ns.fingerprint, source_node_id)
        cached = self._grants.get(key)
        now_ms = int(time.time() * 1000)
        if cached and cached[1] - GRANT_REFRESH_MARGIN_MS > now_ms:
            return cached[0]
        if not self._cp_address:
            raise PermissionDenied("no pull grant: pass PullRequest.grant or configure control_plane_address")
        request = cp_pb.IssuePullGrantRequest(namespace=ns.to_proto(), source_node_id=source_node_id)
        reply = await self._call(lambda stub: stub.IssuePullGrant(request, timeout=5.0))
        self._grants[key] = (reply.token, reply.expires_unix_ms)
        return reply.token

    async def tenant_limit(self, tenant: str) -> int | None:
        """CPU-tier bytes this node may hold for ``tenant`` (None: no limit), from the control plane,
        cached for LIMITS_TTL_S. PermissionDenied: the tenant's policy does not allow this node.
        Without a control plane no tenant policy is enforced here; while it is unreachable the last
        known limit applies (or none)."""
        if not self._cp_address:
            return None
        cached = self._limits.get(tenant)
        if cached and time.monotonic() - cached[0] < LIMITS_TTL_S:
            return cached[1]
        request = cp_pb.GetTenantLimitsRequest(tenant=tenant)
        try:
            reply = await self._call(lambda stub: stub.GetTenantLimits(request, timeout=5.0))
        except Unavailable:
            return cached[1] if cached else None
        limit = reply.max_cpu_tier_bytes_per_node or None
        self._limits[tenant] = (time.monotonic(), limit)
        return limit

    async def _call(self, rpc):
        try:
            async with channel(self._cp_address, self.node_key) as ch:
                return await rpc(cp_grpc.ControlPlaneStub(ch))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise PermissionDenied(f"control plane refused: {exc.details()}") from None
            raise Unavailable(f"control plane unavailable: {exc.code().name} {exc.details()}") from None
