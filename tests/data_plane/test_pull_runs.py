"""A pull whose blocks lie in several runs of slots on both nodes moves each block's bytes into its own landing
slot and nowhere else, whatever the number of transfer lanes; a laned transfer fails as one; the batched CRC check
equals the per-block one."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import numpy as np
import pytest
from crc32c import crc32c

from data_plane.checksum import CrcFolder, RunChecker, checksum
from data_plane.client import DataPlaneClient, SharedTier
from data_plane.shm import SharedRegion
from data_plane.transfer import NixlTransport, NotPosted, TransferFailed

pytestmark = pytest.mark.nixl

N = 10
FILLERS = 14


async def fragmented_slots(client: DataPlaneClient, tier: SharedTier, ns, marker: int, aborted: list[int]) -> list[int]:
    """Reserves FILLERS blocks (slots 0, 1, ... on a new node) and aborts those at ``aborted``, in that order: the
    next reservations take these slots back last-freed first, then the slots after the fillers. The fillers left
    hold ``marker`` bytes (a stray write into them shows). Their slots."""
    fillers = [os.urandom(32) for _ in range(FILLERS)]
    slots = await client.reserve(ns, fillers)
    for slot in slots:
        tier.slot(slot)[:] = marker
    await client.abort(ns, [fillers[i] for i in aborted])
    return [slot for i, slot in enumerate(slots) if i not in aborted]


@pytest.mark.parametrize("lanes", [1, 3])
async def test_a_pull_over_several_runs_of_slots_lands_every_block_in_its_own_slot(local_node, ns, grant, lanes,
                                                                                   block_bytes):
    source = await local_node(node_id="src", transfer_lanes=lanes, capacity_bytes=64 * block_bytes)
    consumer = await local_node(node_id="dst", transfer_lanes=lanes, capacity_bytes=64 * block_bytes)
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        src_tier = SharedTier.open(await owner.describe_tier())
        dst_tier = SharedTier.open(await local.describe_tier())
        try:
            # source slots 11 1 [4 5 6 7 8] [14 15 16], landing slots (a pull reserves the free slots it takes
            # in ascending order) [2 3] 6 8 10 12 [14 15 16 17]: runs contiguous on one side only, on either
            # side, and on both
            await fragmented_slots(owner, src_tier, ns, 0xEE, aborted=[8, 7, 6, 5, 4, 1, 11])
            kept = await fragmented_slots(local, dst_tier, ns, 0xDD, aborted=[3, 2, 12, 10, 8, 6])
            hashes = [os.urandom(32) for _ in range(N)]
            src_slots = await owner.reserve(ns, hashes)
            expected = []
            for i, slot in enumerate(src_slots):
                data = np.frombuffer(os.urandom(dst_tier.block_bytes), dtype=np.uint8)
                src_tier.slot(slot)[:] = data
                expected.append(data.copy())
            await owner.commit(ns, hashes)

            token = grant((await local.describe_tier()).peer_public_key, "dst", "src", ns)
            # generous bound: the first handshake waits for the node's metadata-vetting process to start (seconds)
            result = await local.pull(ns, hashes, "src", source.address, grant=token, timeout_ms=60_000)
            assert result.pulled == N
            dst_slots, lease = await local.acquire(ns, hashes)
            # the case this test is about: several runs on both sides, and not the same runs
            assert src_slots == [11, 1, 4, 5, 6, 7, 8, 14, 15, 16]
            assert dst_slots == [2, 3, 6, 8, 10, 12, 14, 15, 16, 17]
            for i, slot in enumerate(dst_slots):
                assert np.array_equal(dst_tier.slot(slot), expected[i]), f"block {i} (slot {slot}) differs"
            for slot in kept:  # the consumer's other reserved slots were not written into
                assert np.all(dst_tier.slot(slot) == 0xDD), f"slot {slot} was written into"
            await local.release(lease)
        finally:
            src_tier.close()
            dst_tier.close()


@pytest.mark.parametrize("block_bytes", [1, 7, 4096, 65536])
def test_the_folded_crc_of_a_run_is_the_crc_of_its_bytes(block_bytes):
    rng = np.random.default_rng(block_bytes)
    folder = CrcFolder(block_bytes)
    for n in (1, 2, 3, 33):
        data = rng.integers(0, 256, n * block_bytes, dtype=np.uint8)
        crcs = np.array([checksum(data[i * block_bytes:(i + 1) * block_bytes]) for i in range(n)], dtype=np.uint32)
        assert folder.fold(crcs) == crc32c(data)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_batched_check_finds_the_first_changed_block_as_the_per_block_check_does(threads):
    block_bytes, num_slots = 4096, 256
    rng = np.random.default_rng(threads)
    region = SimpleNamespace(array=rng.integers(0, 256, num_slots * block_bytes, dtype=np.uint8))
    slots = np.concatenate([np.arange(10, 60), [3], np.arange(100, 180), [7, 5], np.arange(200, 256)])
    recorded = [checksum(region.array[s * block_bytes:(s + 1) * block_bytes]) for s in slots]
    checker = RunChecker(region, block_bytes, threads)

    def per_block() -> int:
        return next((i for i, s in enumerate(slots)
                     if checksum(region.array[s * block_bytes:(s + 1) * block_bytes]) != recorded[i]), len(slots))

    assert asyncio.run(checker.first_mismatch(slots, recorded)) == per_block() == len(slots)
    for changed in (len(slots) - 1, 120, 51, 50, 0):  # in a long run, at run edges, in a one-slot run
        region.array[slots[changed] * block_bytes + int(rng.integers(block_bytes))] ^= 0x10
        assert asyncio.run(checker.first_mismatch(slots, recorded)) == per_block() == changed
    assert asyncio.run(checker.first_mismatch([], [])) == 0


async def test_a_laned_write_that_times_out_may_still_write_and_closes_the_endpoint(shm_dir, monkeypatch):
    """Three lanes, one deadline: a write whose lanes cannot finish in time fails as one transfer that may still
    write (its endpoint closed), reported only once every lane ended. Control: the same laned write, in time."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    block, slots = 1 << 20, 32
    regions = [SharedRegion(shm_dir / f"lanes{i}.tier", block, slots, owner=True) for i in range(2)]
    src, dst = (NixlTransport(f"lanes{i}", region, progress_wait_ms=10, lanes=3) for i, region in enumerate(regions))
    try:
        for t in (src, dst):
            await t.ready(60.0)
        peer = src.add_peer(dst.metadata())
        offsets = [regions[0].offset(s) for s in range(slots)]
        remote = [regions[1].base_addr + regions[1].offset(s) for s in range(slots)]
        regions[0].array[:] = np.arange(slots * block, dtype=np.uint64).astype(np.uint8)
        await src.write(peer, offsets, remote, block, timeout_s=60.0)  # control
        assert np.array_equal(regions[0].array, regions[1].array)
        # A deadline that falls after the lanes were posted and before they finished: when that is depends on
        # the machine's load, so bounds from 0.5 ms doubling until one does. A write none of whose lanes was
        # posted (NotPosted) keeps its endpoint; one that finished in time proves nothing and the next is tried.
        timed_out = None
        for timeout_s in (0.0005 * 2 ** k for k in range(14)):
            try:
                await src.write(peer, offsets, remote, block, timeout_s=timeout_s)
            except NotPosted:
                continue
            except TransferFailed as exc:
                with pytest.raises(TransferFailed, match="unknown peer"):  # its endpoint was closed
                    await src.write(peer, offsets[:1], remote[:1], block, timeout_s=30.0)
                if exc.may_still_write:
                    timed_out = exc
                    break
                peer = src.add_peer(dst.metadata())  # a lane finished, another never posted: again
        assert timed_out is not None, "no bound fell between posting and finishing"
    finally:
        for t in (src, dst):
            t.close()
        for region in regions:
            region.close()
