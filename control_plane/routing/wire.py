"""Proto <-> routing types (the Route and ReportStats servicer methods' first and last steps)."""

from __future__ import annotations

from kvmesh.errors import InvalidArgument
from kvmesh.repeated import at_most
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb

from control_plane import wire as cp_wire
from control_plane.model import Medium
from control_plane.routing.types import (
    MAX_CANDIDATES,     Candidate, EngineSample, Estimate, KvSource, LinkSample, Policy, PrefetchOrder, PullOutcome, Reason, RouteDecision,
    RouteRequest, SourceDecision, StatsReport,
)


def _policy(value: int) -> Policy | None:
    if value == pb.ROUTE_POLICY_UNSPECIFIED:
        return None
    try:
        return Policy(value)
    except ValueError:
        raise InvalidArgument(f"unknown route policy {value}") from None


def route_request(msg: pb.RouteRequest, max_blocks: int, max_tokens: int) -> RouteRequest:
    """The request, its repeated fields counted before they are read (RouteRequest.validate checks the rest)."""
    return RouteRequest(
        namespace=cp_wire.namespace(msg.namespace, msg.HasField("namespace")),
        candidates=tuple(Candidate(c.engine_id, c.node_id, c.waiting_requests, c.running_tokens)
                         for c in at_most(msg.candidates, MAX_CANDIDATES, "candidates")),
        block_hashes=tuple(at_most(msg.block_hashes, max_blocks, "block hashes")),
        token_ids=tuple(at_most(msg.token_ids, max_tokens, "token ids")),
        extras=cp_wire.extras(msg.extras),
        prompt_tokens=msg.prompt_tokens,
        policy=_policy(msg.policy),
        p2p=not msg.disable_p2p,
        min_cached_token_delta=msg.min_cached_token_delta,
        kv_bytes_per_token=msg.kv_bytes_per_token,
        kv_request_id=msg.kv_request_id,
        prefetch=not msg.disable_prefetch,
    )


def route_decision_to_pb(d: RouteDecision) -> pb.RouteResponse:
    e = d.estimate
    out = pb.RouteResponse(
        engine_id=d.engine_id, reason=d.reason.value, source_decision=d.source_decision.value,
        prompt_tokens=d.prompt_tokens, local_cached_tokens=d.local_cached_tokens,
        estimate=pb.RouteEstimate(queue_ms=e.queue_ms, lookup_ms=e.lookup_ms, transfer_ms=e.transfer_ms,
                                  promotion_ms=e.promotion_ms, prefill_ms=e.prefill_ms, ttft_ms=e.ttft_ms),
        explanation=d.explanation,
    )
    if d.source is not None:
        s = d.source
        out.kv_source.CopyFrom(pb.KvSource(node_id=s.node_id, host=s.host, port=s.port, tier=int(s.tier),
                                           cached_tokens=s.cached_tokens, kv_request_id=s.kv_request_id,
                                           route_token=s.route_token))
        out.remote_kv_source_json = s.to_json()
    if d.prefetch is not None:
        p = d.prefetch
        out.prefetch.CopyFrom(pb.PrefetchOrder(node_id=p.node_id, data_plane_address=p.data_plane_address,
                                               ticket=p.ticket, block_hashes=p.block_hashes))
    return out


def stats_report(msg: pb.ReportStatsRequest) -> StatsReport:
    return StatsReport(
        links=tuple(LinkSample(s.source_node_id, s.dest_node_id, s.bytes_per_s) for s in msg.links),
        engines=tuple(EngineSample(e.engine_id, e.prefill_tokens_per_s) for e in msg.engines),
        pulls=tuple(PullOutcome(p.source_node_id, p.blocks_routed, p.blocks_hit) for p in msg.pulls),
    )


def route_request_to_pb(r: RouteRequest) -> pb.RouteRequest:
    return pb.RouteRequest(
        namespace=r.namespace.to_proto(),
        candidates=[pb.EngineCandidate(engine_id=c.engine_id, node_id=c.node_id, waiting_requests=c.waiting_requests,
                                       running_tokens=c.running_tokens) for c in r.candidates],
        block_hashes=r.block_hashes, token_ids=r.token_ids,
        extras=common_pb2.HashExtras(lora_name=r.extras.lora_name, lora_path=r.extras.lora_path,
                                         cache_salt=r.extras.cache_salt),
        prompt_tokens=r.prompt_tokens, policy=r.policy.value if r.policy else 0, disable_p2p=not r.p2p,
        min_cached_token_delta=r.min_cached_token_delta, kv_bytes_per_token=r.kv_bytes_per_token,
        kv_request_id=r.kv_request_id, disable_prefetch=not r.prefetch,
    )


def route_decision(msg: pb.RouteResponse) -> RouteDecision:
    e = msg.estimate
    source = None
    if msg.HasField("kv_source"):
        s = msg.kv_source
        source = KvSource(s.node_id, s.host, s.port, Medium(s.tier), s.cached_tokens, s.kv_request_id,
                          s.route_token)
    prefetch = None
    if msg.HasField("prefetch"):
        p = msg.prefetch
        prefetch = PrefetchOrder(p.node_id, p.data_plane_address, p.ticket, tuple(p.block_hashes))
    return RouteDecision(
        engine_id=msg.engine_id, reason=Reason(msg.reason), source_decision=SourceDecision(msg.source_decision),
        prompt_tokens=msg.prompt_tokens, local_cached_tokens=msg.local_cached_tokens,
        estimate=Estimate(e.queue_ms, e.lookup_ms, e.transfer_ms, e.promotion_ms, e.prefill_ms), source=source,
        prefetch=prefetch,
    )


def stats_report_to_pb(r: StatsReport) -> pb.ReportStatsRequest:
    return pb.ReportStatsRequest(
        links=[pb.LinkSample(source_node_id=s.source_node_id, dest_node_id=s.dest_node_id, bytes_per_s=s.bytes_per_s)
               for s in r.links],
        engines=[pb.EngineSample(engine_id=e.engine_id, prefill_tokens_per_s=e.prefill_tokens_per_s)
                 for e in r.engines],
        pulls=[pb.PullOutcome(source_node_id=p.source_node_id, blocks_routed=p.blocks_routed, blocks_hit=p.blocks_hit)
               for p in r.pulls],
    )
