"""Route and ReportStats through a real control-plane server over Redis."""

from __future__ import annotations

import json

import grpc
import pytest

from kvmesh.v1 import control_plane_pb2 as pb

from control_plane.model import Medium
from control_plane.routing.stats import RedisStatsStore
from control_plane.routing.types import Policy, Reason, SourceDecision
from control_plane.scheduler_client import Candidate, EngineSample, LinkSample, PullOutcome

BLOCK = 32


def prompt(n_blocks: int) -> list[int]:
    return [(7 * i) % 50_000 for i in range(n_blocks * BLOCK)]


async def hold(stub, admin_key, ns, node: str, address: str, hashes: list[bytes], medium: Medium) -> None:
    md = (("authorization", f"Bearer {admin_key}"),)
    reg = await stub.RegisterNode(pb.RegisterNodeRequest(node=pb.NodeInfo(node_id=node, data_plane_address=address)),
                                  metadata=md)
    ack = await stub.PublishEvents(pb.EventBatch(
        node_id=node, incarnation=reg.incarnation, seq=reg.next_seq, namespace=ns.to_proto(),
        events=[pb.KvEvent(stored=pb.BlockStored(block_hashes=hashes, block_size=BLOCK, medium=int(medium)))]),
        metadata=md)
    assert ack.status == pb.ACK_STATUS_APPLIED


@pytest.fixture
async def fleet(cp_stub, admin_key, ns):
    """node-a's CPU tier holds 40 of the prompt's 64 blocks; node-b holds nothing."""
    tokens = prompt(64)
    hashes = ns.cache_config.hasher().block_hashes(tokens, BLOCK)
    await hold(cp_stub, admin_key, ns, "node-a", "10.1.0.5:7100", hashes[:40], Medium.CPU)
    return tokens


async def test_route_names_a_source_shaped_as_remote_kv_source(scheduler, fleet, cp_stub, admin_key, ns):
    cands = [Candidate("engine-a", "node-a", waiting_requests=4, running_tokens=1000), Candidate("engine-b", "node-b")]
    d = await scheduler.route(cands, token_ids=fleet, policy=Policy.LOAD_AWARE, kv_request_id="req-1")
    assert d.engine_id == "engine-b" and d.reason is Reason.LEAST_LOADED
    assert d.source_decision is SourceDecision.PULL and d.local_cached_tokens == 0
    params = d.kv_transfer_params()["remote_kv_source"]
    assert params.pop("route_token"), "Route signs the source it names (require_route_token)"
    assert params == {
        "kv_request_id": "req-1", "remote_host": "10.1.0.5", "remote_port": 7100, "remote_node_id": "node-a",
        "tier": "CPU", "cached_tokens": 40 * BLOCK}
    raw = await cp_stub.Route(pb.RouteRequest(
        namespace=ns.to_proto(), token_ids=fleet, policy=pb.ROUTE_POLICY_LOAD_AWARE, kv_request_id="req-1",
        candidates=[pb.EngineCandidate(engine_id="engine-a", node_id="node-a", waiting_requests=4),
                    pb.EngineCandidate(engine_id="engine-b", node_id="node-b")]),
        metadata=(("authorization", f"Bearer {admin_key}"),))
    raw_params = json.loads(raw.remote_kv_source_json)
    assert raw_params.pop("route_token") == raw.kv_source.route_token
    assert raw_params == params
    assert raw.kv_source.port == 7100 and raw.kv_source.tier == int(Medium.CPU)
    assert "pull 1280 tokens from node-a" in raw.explanation


async def test_affinity_and_block_hash_prompts(scheduler, fleet, ns):
    hashes = ns.cache_config.hasher().block_hashes(fleet, BLOCK)
    cands = [Candidate("engine-b", "node-b"), Candidate("engine-a", "node-a", 3, 1000)]
    d = await scheduler.route(cands, block_hashes=hashes, prompt_tokens=64 * BLOCK + 5, policy=Policy.AFFINITY)
    assert d.engine_id == "engine-a" and d.reason is Reason.LONGEST_LOCAL_PREFIX
    assert d.local_cached_tokens == 40 * BLOCK and d.prompt_tokens == 64 * BLOCK + 5 and d.source is None


async def test_cost_aware_uses_reported_bandwidth(scheduler, fleet):
    cands = [Candidate("engine-a", "node-a", 0, 200_000), Candidate("engine-b", "node-b")]  # busy, none waiting
    pull = await scheduler.route(cands, token_ids=fleet, policy=Policy.COST_AWARE)
    assert pull.engine_id == "engine-b" and pull.source_decision is SourceDecision.PULL
    await scheduler.report_stats(links=[LinkSample("node-a", "node-b", 1e6)],
                                 engines=[EngineSample("engine-b", 50_000.0)])
    d = await scheduler.route(cands, token_ids=fleet, policy=Policy.COST_AWARE)
    assert d.engine_id == "engine-b" and d.source_decision is SourceDecision.RECOMPUTE_CHEAPER
    assert d.estimate.prefill_ms == pytest.approx(1000 * 64 * BLOCK / 50_000)


async def test_reports_live_in_redis_as_moving_averages(scheduler, control_plane, cp_config):
    await scheduler.report_stats(links=[LinkSample("n1", "n2", 100.0)], engines=[EngineSample("e1", 10.0)])
    await scheduler.report_stats(links=[LinkSample("n1", "n2", 200.0)])
    other = RedisStatsStore(cp_config.redis_url, key_prefix=cp_config.key_prefix, alpha=0.3, refresh_ms=0)
    try:  # what another replica reads
        figures = await other.figures()
        assert figures.link_bytes_per_s[("n1", "n2")] == pytest.approx(0.3 * 200 + 0.7 * 100)
        assert figures.prefill_tokens_per_s["e1"] == 10.0
        assert other.link_key.startswith(f"{cp_config.key_prefix}:{{{cp_config.key_prefix}-reg}}:")
    finally:
        await other.close()


async def test_pull_outcomes_count_stale_routes(scheduler, control_plane):
    await scheduler.report_stats(pulls=[PullOutcome("n1", 10, 10), PullOutcome("n1", 10, 4)])
    counters = control_plane.core.router.counters
    assert counters.pulls_reported == 2 and counters.stale_pulls == 1 and counters.blocks_missed == 6
    assert counters.stale_route_rate == 0.5


@pytest.mark.parametrize("candidates, message", [
    ([], "at least one candidate"),
    ([pb.EngineCandidate(engine_id="e", node_id="n"), pb.EngineCandidate(engine_id="e", node_id="m")],
     "duplicate engine_id"),
    ([pb.EngineCandidate(engine_id="e", node_id="n", running_tokens=-5)], "must be >= 0"),
])
async def test_bad_requests_are_invalid_argument(cp_stub, admin_key, ns, candidates, message):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp_stub.Route(pb.RouteRequest(namespace=ns.to_proto(), token_ids=[1, 2], candidates=candidates),
                            metadata=(("authorization", f"Bearer {admin_key}"),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


async def test_bad_reports_are_invalid_argument(cp_stub, admin_key):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cp_stub.ReportStats(pb.ReportStatsRequest(links=[pb.LinkSample(
            source_node_id="a", dest_node_id="b", bytes_per_s=-1)]),
            metadata=(("authorization", f"Bearer {admin_key}"),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes_per_s" in err.value.details()
