"""A Pull with ``lease_ms`` ends with the engine's Acquire of the same hashes: the same slots and a lease, in one
call. The blocks it has just checked are not checked again; the blocks that were here already are, as an Acquire
checks them (a block changed in memory ends the run)."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.types import BlockKey

pytestmark = pytest.mark.nixl

LOCAL, PULLED = 2, 4


async def fill(client: DataPlaneClient, tier: SharedTier, ns, hashes: list[bytes],
               data: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Writes ``data`` (default: random bytes) into fresh slots for ``hashes`` and commits them; the bytes."""
    data = data or [np.frombuffer(os.urandom(tier.block_bytes), dtype=np.uint8) for _ in hashes]
    for slot, block in zip(await client.reserve(ns, hashes), data):
        tier.slot(slot)[:] = block
    await client.commit(ns, hashes)
    return data


@pytest.fixture
async def pair(local_node, ns, grant, block_bytes):
    """A source holding six blocks, a consumer holding the first two; clients and tiers of both; the grant."""
    source = await local_node(node_id="src", capacity_bytes=32 * block_bytes)
    consumer = await local_node(node_id="dst", capacity_bytes=32 * block_bytes)
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        src_tier, dst_tier = SharedTier.open(await owner.describe_tier()), SharedTier.open(await local.describe_tier())
        hashes = [os.urandom(32) for _ in range(LOCAL + PULLED)]
        data = await fill(owner, src_tier, ns, hashes)
        await fill(local, dst_tier, ns, hashes[:LOCAL], data[:LOCAL])
        token = grant((await local.describe_tier()).peer_public_key, "dst", "src", ns)
        try:
            yield consumer, local, dst_tier, hashes, data, token, source.address
        finally:
            src_tier.close()
            dst_tier.close()


def spy_on_checks(node, monkeypatch) -> list[int]:
    """How many blocks each CRC check on the consumer covered (its pulls' and its Acquires'), in order."""
    checked: list[int] = []
    checker = node.core._checker
    real = checker.first_mismatch

    async def first_mismatch(slots, expected, threads: int = 0, source=None):
        checked.append(len(slots))
        return await real(slots, expected, threads, source)

    monkeypatch.setattr(checker, "first_mismatch", first_mismatch)
    return checked


async def test_a_pull_with_a_lease_answers_the_acquire_of_its_prefix(pair, ns, monkeypatch):
    consumer, local, tier, hashes, data, token, source_address = pair
    checks = spy_on_checks(consumer, monkeypatch)
    result = await local.pull(ns, hashes, "src", source_address, grant=token, timeout_ms=60_000, lease_ms=60_000)
    assert (result.already_local, result.pulled) == (LOCAL, PULLED)
    assert len(result.slots) == LOCAL + PULLED and result.lease_id
    # the pull's check of what it brought, then the Acquire's of the blocks that were here already only
    assert checks == [PULLED, LOCAL]
    for i, slot in enumerate(result.slots):
        assert np.array_equal(tier.slot(slot), data[i]), f"block {i} (slot {slot}) differs from the source's"
    blocks = [consumer.core.tier.get(BlockKey(ns.fingerprint, h)) for h in hashes]
    assert [b.pins for b in blocks] == [1] * len(hashes)  # pinned under the answer's lease
    # The same answer as the Acquire an engine would have called next (that one checks every block).
    slots, lease = await local.acquire(ns, hashes)
    assert slots == result.slots and checks == [PULLED, LOCAL, LOCAL + PULLED]
    await local.release(lease)
    await local.release(result.lease_id)
    assert [b.pins for b in blocks] == [0] * len(hashes)


async def test_a_pull_without_a_lease_pins_nothing(pair, ns):
    consumer, local, _, hashes, _, token, source_address = pair
    result = await local.pull(ns, hashes, "src", source_address, grant=token, timeout_ms=60_000)
    assert result.pulled == PULLED and result.slots == [] and result.lease_id == ""
    assert all(consumer.core.tier.get(BlockKey(ns.fingerprint, h)).pins == 0 for h in hashes)


async def test_a_local_block_changed_in_memory_ends_the_pinned_run(pair, ns):
    """The blocks that were here before the pull are checked as an Acquire checks them: the first one changed
    in memory (a stray write) is dropped and the run ends there, although the pull brought the blocks after it."""
    consumer, local, tier, hashes, _, token, source_address = pair
    changed = consumer.core.tier.get(BlockKey(ns.fingerprint, hashes[1]))
    tier.slot(changed.slot)[5] ^= 0xFF
    result = await local.pull(ns, hashes, "src", source_address, grant=token, timeout_ms=60_000, lease_ms=60_000)
    assert result.pulled == PULLED
    assert len(result.slots) == 1  # block 0 only: block 1 changed, so nothing from there is handed out
    assert consumer.core.tier.get(BlockKey(ns.fingerprint, hashes[1])) is None  # dropped from the tier
    await local.release(result.lease_id)


async def test_a_pull_naming_an_unknown_tier_is_refused_before_it_pulls(pair, ns):
    consumer, local, _, hashes, _, token, source_address = pair
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await local.pull(ns, hashes, "src", source_address, grant=token, timeout_ms=60_000, lease_ms=60_000,
                         media=[99])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "\n" not in refused.value.details()
    assert all(consumer.core.tier.get(BlockKey(ns.fingerprint, h)) is None for h in hashes[LOCAL:])  # nothing pulled
    result = await local.pull(ns, hashes, "src", source_address, grant=token, timeout_ms=60_000)
    assert result.pulled == PULLED  # positive control: the same pull without the bad tier goes through
