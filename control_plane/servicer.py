"""The ControlPlane gRPC servicer: proto -> domain, call the core as the caller, domain -> proto."""

from __future__ import annotations

import asyncio
import contextlib

from kvmesh.errors import InvalidArgument
from kvmesh.grpc_errors import grpc_errors
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc
from tenancy.auth import current_principal
from tenancy.grants import key_id

from control_plane import wire
from control_plane.core import BatchRefused, ControlPlane
from control_plane.model import tier_mask
from control_plane.routing import wire as routing_wire
from control_plane.watch import block_map_update_to_pb


class ControlPlaneServicer(pb_grpc.ControlPlaneServicer):
    def __init__(self, core: ControlPlane) -> None:
        self._core = core

    @grpc_errors
    async def RegisterNode(self, request, context):
        if not request.HasField("node"):
            raise InvalidArgument("node is required")
        reg = await self._core.register_node(current_principal(), wire.node_info(request.node))
        return pb.RegisterNodeResponse(incarnation=reg.incarnation, lease_ms=reg.lease_ms, next_seq=reg.next_seq)

    @grpc_errors
    async def Heartbeat(self, request, context):
        lease_ms = await self._core.heartbeat(current_principal(), request.node_id, request.incarnation)
        return pb.HeartbeatResponse(lease_ms=lease_ms)

    @grpc_errors
    async def DeregisterNode(self, request, context):
        await self._core.deregister_node(current_principal(), request.node_id, request.incarnation)
        return pb.DeregisterNodeResponse()

    @grpc_errors
    async def ListNodes(self, request, context):
        nodes = await self._core.list_nodes(current_principal())
        return pb.ListNodesResponse(nodes=[wire.node_status_to_pb(n) for n in nodes])

    @grpc_errors
    async def PublishEvents(self, request, context):
        """One batch: a refused batch is an error status (RESOURCE_EXHAUSTED / PERMISSION_DENIED)."""
        try:
            return wire.ack_to_pb(await self._core.apply_batch(current_principal(), wire.event_batch(
                request, self._core.config.max_batch_blocks)))
        except BatchRefused as refused:
            raise refused.error from None

    @grpc_errors
    async def StreamEvents(self, request_iterator, context):
        """A stream: a refused batch is acked REFUSED (its seq consumed) so the stream goes on."""
        principal = current_principal()
        async for msg in request_iterator:
            batch = wire.event_batch(msg, self._core.config.max_batch_blocks)
            try:
                yield wire.ack_to_pb(await self._core.apply_batch(principal, batch))
            except BatchRefused as refused:
                yield wire.ack_to_pb(await self._core.refuse_batch(batch, refused))

    @grpc_errors
    async def LookupPrefix(self, request, context):
        return await self._lookup(current_principal(), request)

    @grpc_errors
    async def LookupPrefixStream(self, request_iterator, context):
        """Each request answered as LookupPrefix would, in request order (see :meth:`_in_order`)."""
        principal = current_principal()
        async for answer in self._in_order(request_iterator, lambda request: self._lookup(principal, request)):
            yield answer

    @grpc_errors
    async def LookupPrefixBatches(self, request_iterator, context):
        """Several lookups a message: each answered as LookupPrefix would, one after the other, into one reply
        per batch; batches in request order (see :meth:`_in_order`). A batch is answered whole or not at all."""
        principal = current_principal()
        limit = self._core.config.max_lookup_batch

        async def answer(batch: pb.LookupPrefixBatch) -> pb.LookupPrefixBatchResponse:
            if not 0 < len(batch.lookups) <= limit:
                raise InvalidArgument(f"a batch of {len(batch.lookups)} lookups; send 1 to {limit} (max_lookup_batch)")
            reply = pb.LookupPrefixBatchResponse()
            add = reply.answers.add
            for request in batch.lookups:
                await self._lookup(principal, request, into=add())
            return reply

        async for reply in self._in_order(request_iterator, answer):
            yield reply

    async def _in_order(self, request_iterator, work):
        """Up to ``lookup_stream_window`` requests of the stream worked on at once, and no more of them than
        ``max_request_bytes`` of messages (what the request gate charged the stream for; one larger message is
        worked on alone): their answers yielded in request order. The first failed request ends the stream with
        its status, after the answers to the requests before it (the auth interceptor checks the caller's key
        again before each request)."""
        window = asyncio.Semaphore(self._core.config.lookup_stream_window)
        budget = self._core.config.max_request_bytes
        held = 0  # bytes of the messages being worked on or answered
        room = asyncio.Condition()
        in_flight: asyncio.Queue[tuple[asyncio.Future, int] | None] = asyncio.Queue()

        async def read() -> None:
            nonlocal held
            try:
                async for request in request_iterator:
                    size = request.ByteSize()
                    await window.acquire()
                    async with room:
                        await room.wait_for(lambda: not held or held + size <= budget)
                        held += size
                    in_flight.put_nowait((asyncio.ensure_future(work(request)), size))
            finally:
                in_flight.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await in_flight.get()) is not None:
                task, size = item
                yield await task
                window.release()
                async with room:
                    held -= size
                    room.notify()
            await reader  # the request stream's own end: a revoked key, an undecodable message
        finally:
            for item in [(reader, 0), *(in_flight.get_nowait() for _ in range(in_flight.qsize()))]:
                if item is not None:
                    _discard(item[0])

    async def _lookup(self, principal, request, into: pb.LookupPrefixResponse | None = None
                      ) -> pb.LookupPrefixResponse:
        """One lookup's answer, in ``into`` when given (a batch reply's entry), else in a new message."""
        ns = wire.namespace(request.namespace, request.HasField("namespace"))
        media = [wire.medium(m, "media") for m in request.media]
        config = self._core.config
        hashes = wire.lookup_hashes(request, ns, config.max_lookup_blocks)
        match = await self._core.lookup_prefix(principal, ns, hashes,
                                               wire.token_ids(request.token_ids, config.max_lookup_tokens),
                                               wire.extras(request.extras), tier_mask(media))
        return wire.prefix_match_to_pb(match, into)

    @grpc_errors
    async def IssuePullGrant(self, request, context):
        ns = wire.namespace(request.namespace, request.HasField("namespace"))
        token, expires, address = await self._core.issue_pull_grant(current_principal(), ns, request.source_node_id,
                                                                    request.consumer_public_key)
        return pb.PullGrant(token=token, expires_unix_ms=expires, source_address=address)

    @grpc_errors
    async def GetTenantLimits(self, request, context):
        limit, epoch = await self._core.tenant_limits(current_principal(), request.tenant)
        return pb.TenantLimits(max_cpu_tier_bytes_per_node=limit, tenant_epoch=epoch)

    @grpc_errors
    async def GetGrantKeys(self, request, context):
        current_principal()
        current = self._core.signer.public_key
        return pb.GetGrantKeysResponse(keys=[
            pb.GrantKey(key_id=key_id(k), ed25519_public_key=k, current=k == current)
            for k in self._core.grant_public_keys])

    @grpc_errors
    async def Route(self, request, context):
        config = self._core.config
        decision = await self._core.route(current_principal(), routing_wire.route_request(
            request, config.max_lookup_blocks, config.max_lookup_tokens))
        return routing_wire.route_decision_to_pb(decision)

    @grpc_errors
    async def ReportStats(self, request, context):
        await self._core.report_stats(current_principal(), routing_wire.stats_report(request))
        return pb.ReportStatsResponse()

    @grpc_errors
    async def WatchBlockMap(self, request, context):
        ns = wire.namespace(request.namespace, request.HasField("namespace"))
        async with contextlib.aclosing(self._core.watch_block_map(current_principal(), ns)) as updates:
            async for update in updates:  # closed with the call: the watch counts against the key until then
                yield block_map_update_to_pb(update)

    async def Ping(self, request, context):
        return common_pb2.PingResponse()


def _discard(task: asyncio.Future) -> None:
    """Cancel ``task``, or take its failure if it already failed (an unread one is logged as unretrieved)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()
