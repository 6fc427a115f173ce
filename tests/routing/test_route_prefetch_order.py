"""Route's prefetch order through a real control-plane server over Valkey: when it is given, what it signs, and the
switches that turn it off (per request, per deployment). The data-plane half: tests/prefetch/."""

from __future__ import annotations

import pytest

from kvmesh.errors import PermissionDenied
from kvmesh.v1 import control_plane_pb2 as pb
from tenancy.grants import GrantVerifier

from control_plane.model import Medium
from control_plane.routing.types import Policy, SourceDecision
from control_plane.scheduler_client import Candidate, SchedulerClient

BLOCK = 32
DST = "127.0.0.1:1"  # node-b's registered data plane: nothing listens, so the hand-over fails (and the route stands)


async def register(stub, admin_key, node: str, address: str) -> pb.RegisterNodeResponse:
    return await stub.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(node_id=node, data_plane_address=address)),
                                   metadata=(("authorization", f"Bearer {admin_key}"),))


@pytest.fixture
async def tokens(cp_stub, admin_key, ns) -> list[int]:
    """node-a's CPU tier holds 40 of the prompt's 64 blocks; node-b (live, holding nothing) runs engine-b."""
    tokens = [(11 * i) % 50_000 for i in range(64 * BLOCK)]
    hashes = ns.cache_config.hasher().block_hashes(tokens, BLOCK)
    reg = await register(cp_stub, admin_key, "node-a", "10.1.0.5:7100")
    ack = await cp_stub.PublishEvents(pb.EventBatch(
        node_id="node-a", incarnation=reg.incarnation, seq=reg.next_seq, namespace=ns.to_proto(),
        events=[pb.KvEvent(stored=pb.BlockStored(block_hashes=hashes[:40], block_size=BLOCK,
                                                 medium=int(Medium.CPU)))]),
        metadata=(("authorization", f"Bearer {admin_key}"),))
    assert ack.status == pb.ACK_STATUS_APPLIED
    await register(cp_stub, admin_key, "node-b", DST)
    return tokens


async def route(client: SchedulerClient, tokens: list[int], **kwargs):
    return await client.route([Candidate("engine-b", "node-b")], token_ids=tokens, policy=Policy.LOAD_AWARE,
                              **kwargs)


async def test_a_pull_decision_carries_a_signed_order_for_the_engines_node(scheduler, tokens, control_plane, ns):
    d = await route(scheduler, tokens)
    assert d.source_decision is SourceDecision.PULL and d.source.node_id == "node-a"
    order = d.prefetch
    assert order.node_id == "node-b" and order.data_plane_address == DST
    assert list(order.block_hashes) == ns.cache_config.hasher().block_hashes(tokens, BLOCK)[:40]
    verifier = GrantVerifier(control_plane.core.signer.public_key, "node-b")
    ticket = verifier.verify_prefetch(order.ticket.encode(), namespace_fingerprint=ns.fingerprint, tenant=ns.tenant,
                                      block_hashes=list(order.block_hashes))
    assert (ticket.prefetch_source_node_id, ticket.prefetch_source_address) == ("node-a", "10.1.0.5:7100")
    assert ticket.prefetch_route_token == d.source.route_token
    with pytest.raises(PermissionDenied):  # another node, or other blocks, do not pass
        GrantVerifier(control_plane.core.signer.public_key, "node-a").verify_prefetch(
            order.ticket.encode(), namespace_fingerprint=ns.fingerprint, tenant=ns.tenant,
            block_hashes=list(order.block_hashes))
    with pytest.raises(PermissionDenied):
        verifier.verify_prefetch(order.ticket.encode(), namespace_fingerprint=ns.fingerprint, tenant=ns.tenant,
                                 block_hashes=list(order.block_hashes)[:39])
    # the hand-over failed (nothing listens at node-b's address): said, and the route stands
    assert d.prefetch_status == "UNAVAILABLE"
    assert d.kv_transfer_params()["remote_kv_source"]["remote_node_id"] == "node-a"


async def test_a_request_opts_out(scheduler, tokens):
    d = await route(scheduler, tokens, prefetch=False)
    assert d.source_decision is SourceDecision.PULL and d.prefetch is None and d.prefetch_status == ""


async def test_no_order_to_a_node_that_is_not_live_or_without_a_pull(scheduler, tokens):
    d = await scheduler.route([Candidate("engine-c", "node-c")], token_ids=tokens, policy=Policy.LOAD_AWARE)
    assert d.source_decision is SourceDecision.PULL and d.prefetch is None  # node-c never registered
    d = await route(scheduler, tokens, p2p=False)
    assert d.source is None and d.prefetch is None


async def test_a_deployment_turns_it_off(cp_config, cp_stub, admin_key, ns, tokens):
    from control_plane.server import serve

    running = await serve(cp_config.model_copy(update={"route_prefetch": False}))
    try:
        async with SchedulerClient(f"127.0.0.1:{running.port}", ns, api_key=admin_key) as client:
            d = await route(client, tokens)
        assert d.source_decision is SourceDecision.PULL and d.prefetch is None
    finally:
        await running.stop()
