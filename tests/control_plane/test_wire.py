"""A lookup's answer as the servicer encodes it (control_plane.wire.prefix_match_to_pb: holders encoded once,
remembered, and parsed in as bytes) is the message built field by field, for holders the cache has and has not
seen, with names and addresses long enough for multi-byte lengths, per-tier counts that differ only in one tier,
into a batch reply's entry, and past the cache's limit."""

from __future__ import annotations

from control_plane import wire
from control_plane.model import Medium, NodePrefix, PrefixMatch
from kvmesh.v1 import control_plane_pb2 as pb


def _field_by_field(match: PrefixMatch) -> pb.LookupPrefixResponse:
    return pb.LookupPrefixResponse(blocks_queried=match.blocks_queried, block_hashes=match.block_hashes, holders=[
        pb.NodePrefix(node_id=h.node_id, data_plane_address=h.data_plane_address, leading_blocks=h.leading_blocks,
                      tiers=[pb.TierPrefix(medium=m, leading_blocks=n) for m, n in h.per_tier.items() if n])
        for h in match.holders])


def _holders(step: int) -> list[NodePrefix]:
    return [NodePrefix(f"node-{i}-é" + "x" * (i * 40), f"10.0.{i}.{step % 7}:{5000 + i}" + "/p" * (i * 30),
                       200 * i + step, {Medium.GPU: step % 3 * i, Medium.CPU: 200 * i + step, Medium.DISK: i % 2})
            for i in range(1, 9)]


def test_the_encoded_answer_is_the_message_built_field_by_field():
    for step in range(40):  # the same holders come back (cached), with one tier's count changed, and new ones
        match = PrefixMatch(1024 + step, _holders(step // 2) + _holders(step % 5), [b"h" * 32] * (step % 2))
        reply = wire.prefix_match_to_pb(match)
        assert reply == _field_by_field(match)
        assert wire.prefix_match(pb.LookupPrefixResponse.FromString(reply.SerializeToString())) == PrefixMatch(
            match.blocks_queried, [NodePrefix(h.node_id, h.data_plane_address, h.leading_blocks,
                                              {m: n for m, n in h.per_tier.items() if n}) for h in match.holders],
            match.block_hashes)
        batch = pb.LookupPrefixBatchResponse()
        wire.prefix_match_to_pb(match, batch.answers.add())
        assert batch.answers[0] == _field_by_field(match)
    assert wire.prefix_match_to_pb(PrefixMatch(3, [])) == pb.LookupPrefixResponse(blocks_queried=3)


def test_the_holder_cache_is_bounded():
    for step in range(wire.HOLDER_CACHE_LIMIT // 8 + 10):
        match = PrefixMatch(1, _holders(10_000 + step))
        assert wire.prefix_match_to_pb(match) == _field_by_field(match)
    assert 0 < len(wire._holder_bytes) <= wire.HOLDER_CACHE_LIMIT
