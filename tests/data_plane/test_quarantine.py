"""A pull whose NIXL request could not be cancelled holds the slots of its source's landing arena it used: they
are never handed to a later pull from that source, so a late write cannot land in a reused slot, while its tier
slots are free at once (no transfer reaches the tier). Real NIXL cannot be made to refuse a cancel on demand, so
the failing side's transport is the real one with its byte path replaced by that failure (the real path is
covered by test_reclaim.py and test_multiprocess.py); the control is the same failure with a cancel that worked:
the arena slots are handed out again at once.

Both byte paths: the source WRITEs (the default) or the consumer READs from a ``serve_peer_reads`` source."""

from __future__ import annotations

import os

import pytest

from data_plane.client import DataPlaneClient
from data_plane.transfer import TransferFailed, Transport
from data_plane.types import LookupStatus

from tests.data_plane.helpers import WrappedTransport, commit_blocks

pytestmark = pytest.mark.nixl

N = 3


class FailingTransfers(WrappedTransport):
    """The real transport, except every READ and WRITE fails; ``cancelled``: whether NIXL could cancel it."""

    def __init__(self, real: Transport, cancelled: bool) -> None:
        super().__init__(real)
        self._cancelled = cancelled

    async def read(self, peer, local_addrs, remote_addrs, length, timeout_s):
        raise TransferFailed("READ failed", may_still_write=not self._cancelled)

    async def write(self, peer, local_offsets, remote_addrs, length, timeout_s, tag=b""):
        raise TransferFailed("WRITE failed", may_still_write=not self._cancelled)


def record_landing_slots(arena) -> list[set[int]]:
    """The arena slots each pull takes, from now on."""
    taken: list[set[int]] = []
    real_take = arena.take

    def take(n):
        slots = real_take(n)
        taken.append(set(slots.tolist()))
        return slots

    arena.take = take
    return taken


@pytest.mark.parametrize("path", ["write", "read"])
@pytest.mark.parametrize("cancelled", [False, True], ids=["not-cancelled", "cancelled-control"])
async def test_arena_slots_of_an_uncancellable_transfer_are_never_reused_and_the_tier_loses_none(
        local_node, ns, grant, path, cancelled):
    a = await local_node(node_id="qa", serve_peer_reads=path == "read")
    b = await local_node(node_id="qb")
    async with DataPlaneClient(a.address, key=a.core.config.node_key()) as ca, \
            DataPlaneClient(b.address, key=b.core.config.node_key()) as cb:
        token = grant((await cb.describe_tier()).peer_public_key, "qb", "qa", ns)
        warm = await commit_blocks(ca, ns, 1)
        assert (await cb.pull(ns, warm, "qa", a.address, grant=token)).pulled == 1  # handshaken: the arena is made
        arena = b.core.transport.landing_arena("qa")
        taken = record_landing_slots(arena)
        failing = a if path == "write" else b  # the source's WRITE, or the consumer's own READ
        real = failing.core.transport
        failing.core.transport = FailingTransfers(real, cancelled)
        free = b.core.tier.free_slots
        hashes = await commit_blocks(ca, ns, N)
        result = await cb.pull(ns, hashes, "qa", a.address, grant=token)
        failing.core.transport = real
        assert result.statuses == [LookupStatus.MISS] * N and result.pulled == 0
        assert b.core.tier.free_slots == free, "the failed pull's tier slots are free at once"
        lost = 0 if cancelled else N
        assert b.core.quarantine.held == lost and arena.free_slots == arena.slots - lost
        # the whole tier is handed out, its slots of the failed pull too
        many = [os.urandom(32) for _ in range(b.core.region.num_slots)]
        assert -1 not in await cb.reserve(ns, many[:free])
        await cb.abort(ns, many[:free])
        # the next pull from that source lands elsewhere in its arena while the failed transfer may still write
        again = await cb.pull(ns, hashes, "qa", a.address, grant=token)
        assert again.pulled == N
        first, second = taken[0], taken[1]
        assert len(first) == N and len(second) == N
        if cancelled:
            assert second == first, "control: a cancelled transfer's arena slots are handed out again at once"
        else:
            assert not second & first, "an arena slot the failed transfer may still write into was reused"
        slots, lease = await cb.acquire(ns, hashes)
        assert [int(b.core.region.slot(s)[0]) for s in slots] == list(range(1, N + 1)), "the source's bytes"
        await cb.release(lease)
