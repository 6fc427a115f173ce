"""The DataPlane gRPC service: check the caller, proto -> domain, call the core, domain -> proto.

Callers were authenticated by the interceptor (data_plane.auth): the local API
needs this node's own key; the peer API needs a pull grant for the namespace.
"""

from __future__ import annotations

from dataclasses import replace

from kvmesh.errors import InvalidArgument, PermissionDenied
from kvmesh.grpc_errors import grpc_errors
from kvmesh.namespace import Namespace
from kvmesh.repeated import at_most
from kvmesh.v1 import common_pb2, data_plane_pb2 as pb, data_plane_pb2_grpc

from tenancy.grants import Grant
from tenancy.peer_proof import PeerCall

from data_plane import wire
from data_plane.auth import NodeAuth
from data_plane.core import DataPlaneCore
from data_plane.prefetch import Prefetcher
from data_plane.types import validate_hashes

# A send's WRITE must end (or be cancelled) before the caller's deadline: the caller holds its landing slots
# on a timeout.
SEND_MARGIN_S = 0.25


def lease_holder(grant: Grant | None) -> str:
    """Leases are held by the consumer node and peer key that proved the grant: a peer can release, or have
    the node send, only the leases its own lookups took."""
    return "local" if grant is None else f"peer:{grant.consumer_node_id}:{grant.consumer_public_key}"


class DataPlaneServicer(data_plane_pb2_grpc.DataPlaneServicer):
    def __init__(self, core: DataPlaneCore, auth: NodeAuth, prefetcher: Prefetcher) -> None:
        self._core = core
        self._auth = auth
        self._prefetcher = prefetcher

    # ---- peer API ----

    @grpc_errors
    async def ExchangeAgentMetadata(self, request, context):
        grant = await self._auth.require_grant(context.invocation_metadata(), None,
                                                 PeerCall.of("ExchangeAgentMetadata", request))
        if grant is not None and grant.consumer_node_id != request.node_id:
            raise PermissionDenied(f"the grant was issued to node {grant.consumer_node_id!r}, "
                                   f"not {request.node_id!r}")
        name, metadata, digest = await self._core.sends.exchange_metadata(
            request.node_id, request.agent_metadata, request.block_bytes, context.time_remaining() or 10.0,
            request.agent_challenge_answer)
        return pb.ExchangeAgentMetadataResponse(node_id=self._core.node_id, agent_name=name,
                                                agent_metadata=metadata, block_bytes=self._core.block_bytes,
                                                agent_challenge_sent=bool(digest), agent_challenge_digest=digest)

    def _hashes(self, request) -> list[bytes]:
        """The request's block hashes, counted before they are read (or digested for a peer's proof)."""
        return list(at_most(request.block_hashes, self._core.config.max_hashes_per_request, "block hashes"))

    @grpc_errors
    async def Lookup(self, request, context):
        ns = Namespace.from_proto(request.namespace)
        hashes = self._hashes(request)
        at_most(request.landing_addrs, self._core.config.max_hashes_per_request, "landing addresses")
        grant = await self._auth.require_grant(context.invocation_metadata(), ns, PeerCall.of("Lookup", request))
        if request.landing_addrs or request.lease_id:
            if grant is None:
                raise InvalidArgument("landing_addrs and lease_id are for peers: a local caller acquires blocks "
                                      "instead")
            remaining = context.time_remaining()
            # the caller's deadline, never more than this node's own bound on a pull
            timeout_s = min(self._core.config.pull_timeout_ms / 1000 if remaining is None else remaining,
                            self._core.config.max_pull_timeout_ms / 1000)
            sent = await self._core.sends.send(
                ns, request.lease_id, hashes, list(request.landing_addrs), grant.consumer_node_id,
                lease_holder(grant), timeout_s=max(0.0, timeout_s - SEND_MARGIN_S), grant_epoch=grant.tenant_epoch)
            return wire.send_response(sent, len(hashes), self._core.block_bytes)
        answer = await self._core.lookup(
            ns, hashes,
            consumer=request.consumer_node_id, pending_wait_ms=request.pending_wait_ms,
            lease_ms=request.lease_ms, media=wire.media_from_pb(request.media),
            holder=lease_holder(grant), grant_epoch=None if grant is None else grant.tenant_epoch,
            peer_node="" if grant is None else grant.consumer_node_id)
        return wire.lookup_response(answer, self._core.block_bytes)

    @grpc_errors
    async def Release(self, request, context):
        grant = await self._auth.require_grant(context.invocation_metadata(), None, PeerCall.of("Release", request))
        settled = self._core.settle(request.lease_id, None if grant is None else lease_holder(grant))
        return pb.ReleaseResponse(settled=settled, agent_name=self._core.transport.agent_name)

    # ---- local API ----

    @grpc_errors
    async def Pull(self, request, context):
        self._auth.require_local("Pull")
        ns, hashes = Namespace.from_proto(request.namespace), self._hashes(request)
        media = wire.media_from_pb(request.media)  # read before the pull: bad input is refused before any work
        result = await self._prefetcher.pull(  # the core's pull, joining route-time prefetches (data_plane.prefetch)
            ns, hashes, request.source_node_id, request.source_address, timeout_ms=request.timeout_ms,
            source_media=wire.media_from_pb(request.source_media), first_block_index=request.first_block_index,
            grant=wire.grant_token(request.grant), route_token=wire.grant_token(request.route_token.encode()))
        if request.lease_ms:  # the engine's Acquire, in the same call
            slots, lease_id = await self._acquire(ns, hashes, media, request.lease_ms, checked=result.checked)
            result = replace(result, slots=slots, lease_id=lease_id)
        return wire.pull_response(result)

    @grpc_errors
    async def Prefetch(self, request, context):
        """Route's order (its signed ticket is the authority, not the caller's key: data_plane.prefetch)."""
        ns = Namespace.from_proto(request.namespace).validate()
        hashes = validate_hashes(ns, self._hashes(request), self._core.config.max_hashes_per_request)
        ticket = await self._auth.check_prefetch(request.ticket.encode(), ns, hashes)
        status = self._prefetcher.start(ns, hashes, ticket)
        return pb.PrefetchResponse(status=status.value)

    @grpc_errors
    async def DescribeTier(self, request, context):
        self._auth.require_local("DescribeTier")
        d = self._core.describe()
        return pb.DescribeTierResponse(node_id=d.node_id, shm_path=d.shm_path, block_bytes=d.block_bytes,
                                       num_slots=d.num_slots, locked=d.locked, block_tokens=d.block_tokens,
                                       peer_public_key=self._auth.identity.public_key)

    @grpc_errors
    async def Reserve(self, request, context):
        self._auth.require_local("Reserve")
        ns = Namespace.from_proto(request.namespace)
        limit = await self._auth.tenant_limit(ns.tenant)
        slots = self._core.reserve(
            ns, self._hashes(request), tenant_limit_bytes=limit,
            max_offload_tokens=request.max_offload_tokens, first_block_index=request.first_block_index,
            protected_blocks=request.protected_blocks)
        return pb.ReserveResponse(slots=slots)

    @grpc_errors
    async def Commit(self, request, context):
        self._auth.require_local("Commit")
        n = self._core.commit(Namespace.from_proto(request.namespace), self._hashes(request))
        return pb.CommitResponse(committed=n)

    @grpc_errors
    async def Abort(self, request, context):
        self._auth.require_local("Abort")
        self._core.abort(Namespace.from_proto(request.namespace), self._hashes(request))
        return pb.AbortResponse()

    @grpc_errors
    async def Acquire(self, request, context):
        self._auth.require_local("Acquire")
        ns, hashes = Namespace.from_proto(request.namespace), self._hashes(request)
        slots, lease_id = await self._acquire(ns, hashes, wire.media_from_pb(request.media), request.lease_ms)
        return pb.AcquireResponse(slots=slots, lease_id=lease_id)

    async def _acquire(self, ns: Namespace, hashes: list[bytes], media, lease_ms: int,
                       checked=()) -> tuple[list[int], str]:
        """The engine's Acquire (its own RPC, or a Pull's last step): the core's, then the prefetches it used."""
        slots, lease_id = await self._core.acquire(ns, hashes, media, lease_ms, checked=checked)
        self._prefetcher.acquired(ns, hashes[:len(slots)])
        return slots, lease_id

    @grpc_errors
    async def Ping(self, request, context):
        self._auth.require_local("Ping")
        return common_pb2.PingResponse()
