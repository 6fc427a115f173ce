"""Conversions between data-plane protos and domain types (the only place that knows both)."""

from __future__ import annotations

import re
from itertools import repeat
from typing import Iterable

import numpy as np

from kvmesh.errors import InvalidArgument
from kvmesh.v1 import common_pb2, data_plane_pb2 as pb

from data_plane.types import LookupAnswer, LookupStatus, Medium, PullResult

STATUS_TO_PB = {
    LookupStatus.HIT: pb.BLOCK_STATUS_HIT,
    LookupStatus.MISS: pb.BLOCK_STATUS_MISS,
    LookupStatus.HIT_PENDING: pb.BLOCK_STATUS_HIT_PENDING,
}
STATUS_FROM_PB = {v: k for k, v in STATUS_TO_PB.items()}


def statuses_to_pb(statuses: list[LookupStatus]) -> list[int]:
    """The wire values; an all-HIT or all-MISS list (the usual answers) without a step per block (hashing an
    enum member runs Python code)."""
    for status in (LookupStatus.HIT, LookupStatus.MISS):
        if statuses.count(status) == len(statuses):
            return [STATUS_TO_PB[status]] * len(statuses)
    return [STATUS_TO_PB[s] for s in statuses]


def media_from_pb(values: Iterable[int]) -> frozenset[Medium]:
    """A request's tier list; empty means every tier."""
    values = list(values)
    if not values:
        return frozenset(Medium)
    media = set()
    for v in values:
        if v == common_pb2.MEDIUM_UNSPECIFIED:
            return frozenset(Medium)
        try:
            media.add(Medium(v))
        except ValueError:
            raise InvalidArgument(f"medium {common_pb2.Medium.Name(v) if v in common_pb2.Medium.values() else v} "
                                  "is not a data-plane tier (MEDIUM_CPU, MEDIUM_DISK)") from None
    return frozenset(media)


MAX_GRANT_BYTES = 4096
_PRINTABLE = re.compile(rb"[\x21-\x7e]+")  # printable ASCII, no spaces


def grant_token(raw: bytes) -> bytes:
    """A PullRequest's grant as the data plane forwards it (call metadata): empty, or the printable-ASCII
    token IssuePullGrant returned."""
    if len(raw) > MAX_GRANT_BYTES:
        raise InvalidArgument(f"grant is {len(raw)} bytes; a pull grant token is at most {MAX_GRANT_BYTES}")
    if raw and not _PRINTABLE.fullmatch(raw):
        raise InvalidArgument("grant must be the token IssuePullGrant returned, as is (printable ASCII, no spaces "
                              "or control characters)")
    return raw


def media_to_pb(media: Iterable[Medium] | None) -> list[int]:
    return [] if media is None else sorted(int(m) for m in media)


def lookup_response(answer: LookupAnswer, block_bytes: int) -> pb.LookupResponse:
    """Packed: statuses, addresses (0 for a MISS) and checksums as three arrays, no message per block."""
    addrs = np.asarray(answer.addrs, dtype=np.int64)
    return pb.LookupResponse(
        statuses=statuses_to_pb(answer.statuses),
        addrs=np.maximum(addrs, 0).tolist(),
        lease_id=answer.lease_id,
        block_bytes=block_bytes,
        checksums=answer.checksums,
    )


def lookup_answer(msg: pb.LookupResponse, expected: int) -> LookupAnswer:
    """Checks a source's answer is well-formed (one entry per hash) before trusting it; an unknown status is a
    MISS, and a MISS has no address (-1)."""
    if not (len(msg.statuses) == len(msg.addrs) == len(msg.checksums) == expected):
        raise InvalidArgument(f"malformed lookup answer: {len(msg.statuses)} statuses, {len(msg.addrs)} addresses "
                              f"and {len(msg.checksums)} checksums for {expected} hashes")
    codes = np.array(msg.statuses, dtype=np.int64)
    misses = np.flatnonzero(codes != pb.BLOCK_STATUS_HIT).tolist()
    statuses = list(map(STATUS_FROM_PB.get, codes.tolist(), repeat(LookupStatus.MISS))) if misses else \
        [LookupStatus.HIT] * expected
    addrs = list(msg.addrs)
    for i in misses:
        addrs[i] = -1
    return LookupAnswer(statuses, addrs, list(msg.checksums), msg.lease_id)


def send_response(sent: int, n: int, block_bytes: int) -> pb.LookupResponse:
    """A send's answer: HIT for the ``sent`` leading blocks written, MISS for the other ``n - sent``."""
    return pb.LookupResponse(statuses=[pb.BLOCK_STATUS_HIT] * sent + [pb.BLOCK_STATUS_MISS] * (n - sent),
                             block_bytes=block_bytes)


def sent_blocks(msg: pb.LookupResponse, expected: int) -> int:
    """How many leading blocks a source's send answer says it wrote (checked: one status per hash)."""
    if len(msg.statuses) != expected:
        raise InvalidArgument(f"malformed send answer: {len(msg.statuses)} statuses for {expected} hashes")
    sent = 0
    for status in msg.statuses:
        if status != pb.BLOCK_STATUS_HIT:
            break
        sent += 1
    return sent


def pull_response(result: PullResult) -> pb.PullResponse:
    return pb.PullResponse(
        blocks_pulled=result.pulled,
        blocks_already_local=result.already_local,
        bytes_pulled=result.bytes_pulled,
        statuses=statuses_to_pb(result.statuses),
        lookup_ms=result.lookup_ms,
        transfer_ms=result.transfer_ms,
        blocks_joined=result.joined,
        refused=result.refused,
        slots=result.slots,
        lease_id=result.lease_id,
    )


def pull_result(msg: pb.PullResponse) -> PullResult:
    return PullResult(
        statuses=list(map(STATUS_FROM_PB.get, msg.statuses, repeat(LookupStatus.MISS))),
        pulled=msg.blocks_pulled,
        already_local=msg.blocks_already_local,
        bytes_pulled=msg.bytes_pulled,
        lookup_ms=msg.lookup_ms,
        transfer_ms=msg.transfer_ms,
        joined=msg.blocks_joined,
        refused=msg.refused,
        slots=list(msg.slots),
        lease_id=msg.lease_id,
    )
