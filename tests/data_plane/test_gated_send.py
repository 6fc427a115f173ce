"""The gated pull's two calls (a Lookup that pins the source's HITs under a lease, then the send that names the
lease and the landing slots): what happens when something goes wrong between them. Both nodes are real (gRPC,
NIXL over UCX); the consumer runs in this process so the test can act at the exact moment between the calls (after
the consumer reserved its landing slots, before it sends)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from data_plane.client import DataPlaneClient
from data_plane.types import LookupStatus

from tests.data_plane.helpers import commit_blocks

pytestmark = pytest.mark.nixl

N = 4


def between_the_calls(monkeypatch, consumer, act) -> list[int]:
    """Runs ``act()`` on ``consumer`` right after it reserved landing slots for the source's answer (before
    it sends); returns a list that counts the slots each time reserved."""
    reserved: list[int] = []
    real = consumer.core.pulls._reserve_for_pull

    def reserve_then_act(*args, **kwargs):
        out = real(*args, **kwargs)
        reserved.append(len(out[0]))
        act()
        return out

    monkeypatch.setattr(consumer.core.pulls, "_reserve_for_pull", reserve_then_act)
    return reserved


async def test_a_lease_that_expired_before_the_send_is_a_clean_miss(local_node, ns, grant, monkeypatch):
    """The source's lease (capped at 1 ms here) ends before the send names it: the source writes nothing and
    answers MISS, and the consumer frees its landing slots (none held: nothing can still land).
    Control: the same pull, with the same pause between the calls, from a source whose lease outlives it."""
    short = await local_node(node_id="short", lease_ms=1, max_lease_ms=1, lease_sweep_ms=600_000)  # no sweep
    usual = await local_node(node_id="usual")
    consumer = await local_node(node_id="consumer")
    between_the_calls(monkeypatch, consumer, lambda: time.sleep(0.05))  # both nodes wait: the loop is shared
    async with DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        key = (await local.describe_tier()).peer_public_key
        for source, expect_pulled in ((usual, N), (short, 0)):
            async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner:
                hashes = await commit_blocks(owner, ns, N)
            free = consumer.core.tier.free_slots
            result = await local.pull(ns, hashes, source.core.node_id, source.address,
                                      grant=grant(key, "consumer", source.core.node_id, ns))
            assert result.pulled == expect_pulled
            if not expect_pulled:
                assert result.statuses == [LookupStatus.MISS] * N
                assert consumer.core.tier.free_slots == free and consumer.core.quarantine.held == 0
                source.core.expire_leases()  # the sweep ends the expired lease: nothing stays pinned
                assert [b.pins for b in source.core.tier.committed()] == [0] * N


async def test_a_source_frozen_between_the_calls_is_a_bounded_miss_that_evicts_nothing(
        local_node, dp_process, ns, grant, monkeypatch):
    """The source answers the Lookup, then freezes (SIGSTOP: sockets open, nothing answers) before the send:
    the pull answers MISS within its deadline, and no block the consumer held is evicted (its tier slots came
    from free ones and are free again; the slots of the source's landing arena are held, as the frozen source's
    WRITE could still land there). Control: the same source, not frozen, is pulled from first."""
    source = dp_process("src")
    consumer = await local_node(node_id="consumer", capacity_bytes=16 * 64 * 1024,
                                reclaim_retry_ms=600_000)  # reclaiming is test_reclaim.py's
    async with DataPlaneClient(source.address, key=source.api_key) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        own = await commit_blocks(local, ns, 6)  # the consumer's own prefix
        control, frozen = await commit_blocks(owner, ns, N), await commit_blocks(owner, ns, N)
        token = grant((await local.describe_tier()).peer_public_key, "consumer", "src", ns)
        assert (await local.pull(ns, control, "src", source.address, grant=token)).pulled == N
        reserved = between_the_calls(monkeypatch, consumer, lambda: os.kill(source.proc.pid, signal.SIGSTOP))
        free = consumer.core.tier.free_slots
        try:
            t0 = time.monotonic()
            result = await local.pull(ns, frozen, "src", source.address, grant=token, timeout_ms=1_500)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(source.proc.pid, signal.SIGCONT)
        assert reserved == [N], "the source answered the Lookup with HITs before it froze"
        assert result.pulled == 0 and result.statuses == [LookupStatus.MISS] * N
        assert elapsed < 1.5 + 2.0  # the pull's one deadline, plus scheduling slack on a shared host
        slots, lease = await local.acquire(ns, own + control)
        assert len(slots) == len(own) + N, "nothing the consumer held was evicted"
        await local.release(lease)
        assert consumer.core.quarantine.held == N and consumer.core.tier.free_slots == free
