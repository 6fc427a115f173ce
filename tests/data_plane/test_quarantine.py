"""A pull whose NIXL request could not be cancelled quarantines its slots: they are never handed out
again, so a late write cannot land in a reused slot. Real NIXL cannot be made to refuse a cancel on
demand, so the source's transport is the real one with its WRITE (the gated byte path) replaced by that
failure (the real path is covered by test_multiprocess.py); the control is the same failure with a cancel
that worked: the source answers MISS and the consumer frees its landing slots."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.transfer import TransferFailed, Transport
from data_plane.types import LookupStatus

from tests.data_plane.helpers import WrappedTransport

pytestmark = pytest.mark.nixl


class FailingTransfers(WrappedTransport):
    """The real transport, except every READ and WRITE fails; ``cancelled``: whether NIXL could cancel it."""

    def __init__(self, real: Transport, cancelled: bool) -> None:
        super().__init__(real)
        self._cancelled = cancelled

    async def read(self, peer, local_offsets, remote_addrs, length, timeout_s):
        raise TransferFailed("READ failed", may_still_write=not self._cancelled)

    async def write(self, peer, local_offsets, remote_addrs, length, timeout_s, tag=b""):
        raise TransferFailed("WRITE failed", may_still_write=not self._cancelled)

    def close(self):
        self._real.close()


@pytest.mark.parametrize("cancelled", [False, True], ids=["cancelled-control", "not-cancelled"])
async def test_slots_of_an_uncancellable_transfer_are_never_reused(local_node, ns, grant, cancelled):
    a, b = await local_node(node_id="qa"), await local_node(node_id="qb")
    hashes = [os.urandom(32) for _ in range(3)]
    async with DataPlaneClient(a.address, key=a.core.config.node_key()) as ca, \
            DataPlaneClient(b.address, key=b.core.config.node_key()) as cb:
        tier = SharedTier.open(await ca.describe_tier())
        for slot in await ca.reserve(ns, hashes):
            tier.slot(slot)[:] = np.uint8(slot + 1)
        tier.close()
        await ca.commit(ns, hashes)
        real = a.core.transport
        a.core.transport = FailingTransfers(real, cancelled)  # the source's WRITE into b's slots fails
        free = b.core.tier.free_slots
        token = grant((await cb.describe_tier()).peer_public_key, "qb", "qa", ns)
        result = await cb.pull(ns, hashes, "qa", a.address, grant=token)
        assert result.statuses == [LookupStatus.MISS] * 3 and result.pulled == 0
        lost = 0 if cancelled else 3
        assert b.core.tier.quarantined == lost and b.core.tier.free_slots == free - lost
        # fill the whole tier twice over: a quarantined slot is never handed out again
        handed = set()
        for _ in range(2):
            many = [os.urandom(32) for _ in range(b.core.region.num_slots)]
            slots = await cb.reserve(ns, many)
            handed |= {s for s in slots if s >= 0}
            await cb.abort(ns, many)
        assert len(handed) == b.core.region.num_slots - lost
        a.core.transport = real
