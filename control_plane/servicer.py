"""The ControlPlane gRPC servicer: proto -> domain, call the core, domain -> proto."""

from __future__ import annotations

from kvmesh.errors import InvalidArgument
from kvmesh.grpc_errors import grpc_errors
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb, control_plane_pb2_grpc as pb_grpc

from control_plane import wire
from control_plane.core import ControlPlane
from control_plane.model import tier_mask


class ControlPlaneServicer(pb_grpc.ControlPlaneServicer):
    def __init__(self, core: ControlPlane) -> None:
        self._core = core

    @grpc_errors
    async def RegisterNode(self, request, context):
        if not request.HasField("node"):
            raise InvalidArgument("node is required")
        reg = await self._core.register_node(wire.node_info(request.node))
        return pb.RegisterNodeResponse(incarnation=reg.incarnation, lease_ms=reg.lease_ms, next_seq=reg.next_seq)

    @grpc_errors
    async def Heartbeat(self, request, context):
        lease_ms = await self._core.heartbeat(request.node_id, request.incarnation)
        return pb.HeartbeatResponse(lease_ms=lease_ms)

    @grpc_errors
    async def DeregisterNode(self, request, context):
        await self._core.deregister_node(request.node_id, request.incarnation)
        return pb.DeregisterNodeResponse()

    @grpc_errors
    async def ListNodes(self, request, context):
        nodes = await self._core.list_nodes()
        return pb.ListNodesResponse(nodes=[wire.node_status_to_pb(n) for n in nodes])

    @grpc_errors
    async def PublishEvents(self, request, context):
        return wire.ack_to_pb(await self._core.apply_batch(wire.event_batch(request)))

    @grpc_errors
    async def StreamEvents(self, request_iterator, context):
        async for batch in request_iterator:
            yield wire.ack_to_pb(await self._core.apply_batch(wire.event_batch(batch)))

    @grpc_errors
    async def LookupPrefix(self, request, context):
        ns = wire.namespace(request.namespace, request.HasField("namespace"))
        media = [wire.medium(m, "media") for m in request.media]
        match = await self._core.lookup_prefix(
            ns, list(request.block_hashes), list(request.token_ids), wire.extras(request.extras), tier_mask(media)
        )
        return wire.prefix_match_to_pb(match)

    async def Ping(self, request, context):
        return common_pb2.PingResponse()
