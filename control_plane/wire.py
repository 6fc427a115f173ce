"""Proto <-> domain conversions for the control plane (the servicer's first and last step)."""

from __future__ import annotations

from kvmesh.errors import InvalidArgument
from kvmesh.hashing import Extras
from kvmesh.namespace import Namespace
from kvmesh.repeated import at_most
from kvmesh.v1 import common_pb2, control_plane_pb2 as pb

from control_plane.model import (
    MAX_CLEARS_PER_BATCH, Ack, AckStatus, Cleared, EventBatch, Event, Medium, NodeInfo, NodePrefix, NodeStatus,
    PackedHashes, PrefixMatch, Removed, Stored,
)

_ACK_TO_PB = {
    AckStatus.APPLIED: pb.ACK_STATUS_APPLIED,
    AckStatus.DUPLICATE: pb.ACK_STATUS_DUPLICATE,
    AckStatus.RESYNC_REQUIRED: pb.ACK_STATUS_RESYNC_REQUIRED,
    AckStatus.REFUSED: pb.ACK_STATUS_REFUSED,
}


def medium_or_none(value: int, what: str) -> Medium | None:
    if value == common_pb2.MEDIUM_UNSPECIFIED:
        return None
    try:
        return Medium(value)
    except ValueError:
        raise InvalidArgument(f"{what}: unknown medium {value}") from None


def medium(value: int, what: str) -> Medium:
    m = medium_or_none(value, what)
    if m is None:
        raise InvalidArgument(f"{what}: medium must be GPU, CPU or DISK")
    return m


_NO_EXTRAS = Extras()


def extras(msg: common_pb2.HashExtras) -> Extras:
    if not (msg.lora_name or msg.lora_path or msg.cache_salt):
        return _NO_EXTRAS  # the usual case: one shared (immutable) value, nothing to check
    return Extras(lora_name=msg.lora_name, lora_path=msg.lora_path, cache_salt=msg.cache_salt).validate()


def namespace(msg: common_pb2.Namespace, present: bool) -> Namespace:
    if not present:
        raise InvalidArgument("namespace is required")
    return Namespace.from_proto(msg)


def lookup_hashes(msg: pb.LookupPrefixRequest, ns: Namespace, max_blocks: int) -> list[bytes] | PackedHashes:
    """A lookup's block hashes: ``packed_block_hashes`` as they came (the core checks their length), else
    ``block_hashes`` (possibly none: a lookup by token ids), at most ``max_blocks`` of them."""
    if msg.packed_block_hashes:
        if len(msg.block_hashes):
            raise InvalidArgument("give block_hashes or packed_block_hashes, not both")
        return PackedHashes(msg.packed_block_hashes, ns.cache_config.hash_algo.digest_size)
    return list(at_most(msg.block_hashes, max_blocks, "block hashes"))


def token_ids(values, max_tokens: int) -> list[int]:
    """A request's token ids, at most ``max_tokens`` of them."""
    return list(at_most(values, max_tokens, "token ids"))


def node_info(msg: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(msg.node_id, msg.data_plane_address, msg.pool, dict(msg.labels))


def node_info_to_pb(node: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(node_id=node.node_id, data_plane_address=node.data_plane_address,
                       pool=node.pool, labels=node.labels)


def node_status_to_pb(status: NodeStatus) -> pb.NodeStatus:
    return pb.NodeStatus(node=node_info_to_pb(status.node), incarnation=status.incarnation, live=status.live,
                         last_seq=status.last_seq, lease_expires_unix_ms=status.lease_expires_unix_ms)


def _event(msg: pb.KvEvent, i: int) -> Event:
    kind = msg.WhichOneof("event")
    if kind == "stored":
        s = msg.stored
        return Stored(tuple(s.block_hashes), medium(s.medium, f"event {i}"), s.block_size,
                      s.parent_block_hash, tuple(s.token_ids))
    if kind == "removed":
        return Removed(tuple(msg.removed.block_hashes), medium_or_none(msg.removed.medium, f"event {i}"))
    if kind == "cleared":
        return Cleared(medium_or_none(msg.cleared.medium, f"event {i}"))
    raise InvalidArgument(f"event {i} is empty: set stored, removed or cleared")


def event_batch(msg: pb.EventBatch, max_blocks: int) -> EventBatch:
    """The batch, counted first: at most ``max_blocks`` block hashes, MAX_CLEARS_PER_BATCH clears and events
    (each but a clear carries a block), and no stored event with more token ids than its blocks hold
    (EventBatch.validate checks the rest)."""
    ns = namespace(msg.namespace, msg.HasField("namespace"))
    events = at_most(msg.events, max_blocks + MAX_CLEARS_PER_BATCH, "events")
    blocks = clears = 0
    for i, e in enumerate(events):
        kind = e.WhichOneof("event")
        if kind == "cleared":
            clears += 1
            if clears > MAX_CLEARS_PER_BATCH:
                raise InvalidArgument(f"batch clears more than {MAX_CLEARS_PER_BATCH} times; the limit is "
                                      f"{MAX_CLEARS_PER_BATCH} (send the rest in later batches)")
        elif kind == "stored":
            blocks += len(e.stored.block_hashes)
            if len(e.stored.token_ids) > len(e.stored.block_hashes) * ns.cache_config.block_size:
                raise InvalidArgument(f"event {i}: {len(e.stored.token_ids)} token ids for "
                                      f"{len(e.stored.block_hashes)} blocks of {ns.cache_config.block_size} tokens")
        elif kind == "removed":
            blocks += len(e.removed.block_hashes)
    if blocks > max_blocks:
        raise InvalidArgument(f"batch carries {blocks} blocks; the limit is {max_blocks}")
    return EventBatch(
        node_id=msg.node_id,
        incarnation=msg.incarnation,
        seq=msg.seq,
        namespace=ns,
        events=tuple(_event(e, i) for i, e in enumerate(events)),
        reset=msg.reset,
    )


def event_to_pb(event: Event) -> pb.KvEvent:
    if isinstance(event, Stored):
        return pb.KvEvent(stored=pb.BlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids, block_size=event.block_size, medium=int(event.medium)))
    if isinstance(event, Removed):
        return pb.KvEvent(removed=pb.BlockRemoved(block_hashes=event.block_hashes,
                                                  medium=int(event.medium or 0)))
    return pb.KvEvent(cleared=pb.AllBlocksCleared(medium=int(event.medium or 0)))


def ack_to_pb(ack: Ack) -> pb.EventAck:
    return pb.EventAck(seq=ack.seq, status=_ACK_TO_PB[ack.status], expected_seq=ack.expected_seq,
                       blocks_applied=ack.blocks_applied, detail=ack.detail)


HOLDER_CACHE_LIMIT = 10_000  # encoded holders remembered (a cache: cleared when full)
_HOLDERS_FIELD = 2  # LookupPrefixResponse.holders
_holder_bytes: dict[tuple, bytes] = {}


def prefix_match_to_pb(match: PrefixMatch, into: pb.LookupPrefixResponse | None = None) -> pb.LookupPrefixResponse:
    """The answer, filled into ``into`` (an empty message, e.g. a batch reply's entry) or a new message. The
    holders go in as bytes, each encoded once and remembered (the same holders answer lookup after lookup), parsed
    in one call: setting each holder's fields from Python cost twice as much, on every lookup."""
    reply = pb.LookupPrefixResponse() if into is None else into
    reply.blocks_queried = match.blocks_queried
    if match.block_hashes:
        reply.block_hashes.extend(match.block_hashes)
    if match.holders:
        reply.MergeFromString(b"".join([_holder_bytes.get(key) or _encode_holder(key) for key in
                                        [(h.node_id, h.data_plane_address, h.leading_blocks, *h.per_tier.items())
                                         for h in match.holders]]))
    return reply


def _encode_holder(key: tuple) -> bytes:
    """A NodePrefix as a field of LookupPrefixResponse (tag, length, message), from its cache key."""
    node_id, address, leading, *tiers = key
    holder = pb.NodePrefix(node_id=node_id, data_plane_address=address, leading_blocks=leading,
                           tiers=[pb.TierPrefix(medium=medium, leading_blocks=n) for medium, n in tiers if n])
    encoded = holder.SerializeToString()
    if len(_holder_bytes) >= HOLDER_CACHE_LIMIT:
        _holder_bytes.clear()
    _holder_bytes[key] = encoded = _varint(_HOLDERS_FIELD << 3 | 2) + _varint(len(encoded)) + encoded
    return encoded


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def prefix_match(reply: pb.LookupPrefixResponse) -> PrefixMatch:
    """A lookup's answer, on the client side."""
    return PrefixMatch(reply.blocks_queried, [
        NodePrefix(h.node_id, h.data_plane_address, h.leading_blocks,
                   {Medium(t.medium): t.leading_blocks for t in h.tiers}) for h in reply.holders],
        list(reply.block_hashes))


def lookup_request_to_pb(ns: Namespace, block_hashes, token_ids, extras_: Extras,
                         media) -> pb.LookupPrefixRequest:
    """Hashes of the namespace's size go packed (``packed_block_hashes``); any other, as they are, so that the
    server names the one that is wrong."""
    hashes = {}
    if block_hashes:
        whole = set(map(len, block_hashes)) == {ns.cache_config.hash_algo.digest_size}
        hashes = {"packed_block_hashes": b"".join(block_hashes)} if whole else {"block_hashes": block_hashes}
    return pb.LookupPrefixRequest(namespace=ns.to_proto(), token_ids=token_ids, **hashes,
                                  extras=common_pb2.HashExtras(lora_name=extras_.lora_name,
                                                               lora_path=extras_.lora_path,
                                                               cache_salt=extras_.cache_salt),
                                  media=[int(m) for m in media])
