"""Where a source WRITEs on the consumer: its own landing arena, never the CPU tier (data_plane/landing.py).

A source holds the NIXL metadata its consumer hands it, and with it can READ and WRITE whatever it describes.
So the consumer hands each source node metadata of that node's arena only; a pull's blocks land there, and are
copied into the tier and checked there (the copy, not the arena). The attack itself, played by a node-key
holder with its own NIXL agent, is in tests/security/test_write_path_identity.py.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.checksum import MAX_AUTO_THREADS, RunChecker, check_threads, checksum, copy_and_checksum
from data_plane.config import DataPlaneConfig
from data_plane.landing import LandingArena
from data_plane.nixl_metadata import read_agent_metadata
from data_plane.shm import SharedRegion
from data_plane.transfer import LandingArenasFull, NixlTransport
from data_plane.types import LookupStatus

from tests.data_plane import test_pull_with_lease as with_lease
from tests.data_plane.test_pull_with_lease import LOCAL, PULLED, fill

pair = with_lease.pair  # the fixture: a source holding six blocks, a consumer holding the first two

pytestmark = pytest.mark.nixl


async def test_a_source_is_handed_its_own_arena_and_the_pull_lands_there(pair, ns):
    consumer, local, tier, hashes, data, token, source_address = pair
    result = await local.pull(ns, hashes, "src", source_address, grant=token, timeout_ms=60_000)
    assert (result.already_local, result.pulled) == (LOCAL, PULLED)
    transport = consumer.core.transport
    arena = transport.landing_arena("src")
    assert arena is not None and arena.free_slots == arena.size // tier.block_bytes, "every landing slot back"
    bb = tier.block_bytes
    for i in range(PULLED):  # the source WROTE into its arena (slots lowest first) ...
        assert np.array_equal(arena.array[i * bb:(i + 1) * bb], data[LOCAL + i])
    slots, lease = await local.acquire(ns, hashes)  # ... and the tier holds the copies
    for i, slot in enumerate(slots):
        assert np.array_equal(tier.slot(slot), data[i])
    await local.release(lease)
    described = read_agent_metadata(transport.landing_metadata("src"))
    assert described.regions == ((arena.base_addr, arena.size),), "the source is handed its arena, nothing else"
    region = consumer.core.region
    assert not any(base < region.base_addr + region.size and region.base_addr < base + length
                   for base, length in described.regions), "no byte of the tier is described"
    assert read_agent_metadata(transport.metadata()).regions == ((region.base_addr, region.size),), \
        "control: the agent's full metadata is the tier"


async def test_each_source_node_gets_an_arena_of_its_own(shm_dir):
    region = SharedRegion(shm_dir / "arenas.tier", 4096, 8, owner=True)
    transport = NixlTransport("arenas-node", region, landing_slots=2, max_landing_sources=2)
    try:
        await transport.ready(120.0)
        a = read_agent_metadata(transport.landing_metadata("a")).regions
        b = read_agent_metadata(transport.landing_metadata("b")).regions
        assert a != b and len(a) == len(b) == 1
        assert a[0][1] == b[0][1] == 2 * 4096
        assert read_agent_metadata(transport.landing_metadata("a")).regions == a, "the same arena next time"
        with pytest.raises(LandingArenasFull, match="raise max_landing_sources"):
            transport.landing_metadata("c")
        assert transport.landing_arena("c") is None
        old = transport.landing_arena("a")
        old.array[:4] = 7
        assert await transport.rotate(), "a new agent: every arena goes with the old one"
        assert transport.landing_arena("a") is None and transport.landing_arena("b") is None
        transport.landing_metadata("c")  # room again
        assert transport.landing_arena("c") is not None
        assert (old.array[:4] == 7).all(), "an arena a pull still holds stays mapped"
    finally:
        transport.close()
        region.close()


async def test_a_pull_brings_what_fits_in_the_sources_arena(local_node, ns, grant, block_bytes):
    """An arena of two blocks: a pull of four brings the leading two and MISSes the rest (recomputed), within its
    deadline; the next pull brings two more. Control: the default arena takes all four (test above)."""
    source = await local_node(node_id="src", capacity_bytes=32 * block_bytes)
    consumer = await local_node(node_id="dst", capacity_bytes=32 * block_bytes,
                                landing_bytes_per_source=2 * block_bytes)
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        src_tier = SharedTier.open(await owner.describe_tier())
        hashes = [os.urandom(32) for _ in range(4)]
        await fill(owner, src_tier, ns, hashes)
        src_tier.close()
        token = grant((await local.describe_tier()).peer_public_key, "dst", "src", ns)
        first = await local.pull(ns, hashes, "src", source.address, grant=token, timeout_ms=30_000)
        assert first.pulled == 2 and first.statuses[2:] == [LookupStatus.MISS] * 2
        second = await local.pull(ns, hashes, "src", source.address, grant=token, timeout_ms=30_000)
        assert (second.already_local, second.pulled) == (2, 2)


async def test_a_pull_evicts_no_more_than_its_arena_can_land(local_node, ns, grant, block_bytes):
    """A full tier of four of the consumer's own blocks and an arena of two: a pull of four evicts two (the oldest)
    to land two, never four for blocks it cannot bring; the two newest stay (control: they were there)."""
    source = await local_node(node_id="src", capacity_bytes=32 * block_bytes)
    consumer = await local_node(node_id="dst", capacity_bytes=4 * block_bytes,
                                landing_bytes_per_source=2 * block_bytes)
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        src_tier, dst_tier = SharedTier.open(await owner.describe_tier()), SharedTier.open(await local.describe_tier())
        hashes, own = [os.urandom(32) for _ in range(4)], [os.urandom(32) for _ in range(4)]
        await fill(owner, src_tier, ns, hashes)
        for h in own:  # one at a time: LRU order own[0] (oldest) .. own[3]
            await fill(local, dst_tier, ns, [h])
        src_tier.close()
        dst_tier.close()
        slots, lease = await local.acquire(ns, own[2:])
        assert len(slots) == 2, "control: the consumer holds its own blocks"
        await local.release(lease)
        token = grant((await local.describe_tier()).peer_public_key, "dst", "src", ns)
        assert (await local.pull(ns, hashes, "src", source.address, grant=token, timeout_ms=30_000)).pulled == 2
        slots, lease = await local.acquire(ns, own[2:])
        assert len(slots) == 2, "the pull evicted blocks it had no room to land"
        await local.release(lease)


async def test_a_node_at_its_arena_cap_replaces_its_agent_and_then_pulls_from_the_new_source(
        local_node, ns, grant, block_bytes):
    """max_landing_sources=1: a pull from a second source answers MISS (bounded) and has the node replace its NIXL
    agent once nothing runs; the next pull from that source brings its blocks, and the first source, handshaking
    again, gets a new arena too."""
    sources = [await local_node(node_id=f"src{i}", capacity_bytes=32 * block_bytes) for i in (1, 2)]
    consumer = await local_node(node_id="dst", capacity_bytes=32 * block_bytes, max_landing_sources=1)
    transport = consumer.core.transport
    hashes = {}
    for source in sources:
        async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner:
            tier = SharedTier.open(await owner.describe_tier())
            hashes[source.core.node_id] = [os.urandom(32) for _ in range(2)]
            await fill(owner, tier, ns, hashes[source.core.node_id])
            tier.close()
    async with DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        key = (await local.describe_tier()).peer_public_key

        async def pull(source, **kw):
            node_id = source.core.node_id
            return await local.pull(ns, hashes[node_id], node_id, source.address, timeout_ms=30_000,
                                    grant=grant(key, "dst", node_id, ns), **kw)

        async def renewed(previous: str) -> None:
            for _ in range(600):  # the agent is replaced in the background once no pull or send runs
                if transport.landing_arena(previous) is None and not consumer.core.quarantine.renewing:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the agent was never replaced")

        assert (await pull(sources[0])).pulled == 2, "control: the first source gets the one arena"
        first_arena = transport.landing_arena("src1")
        assert (await pull(sources[1])).pulled == 0, "no arena for a second source: MISS"
        await renewed("src1")
        assert (await pull(sources[1])).pulled == 2, "the second source, after the agent was replaced"
        async with DataPlaneClient(sources[0].address, key=sources[0].core.config.node_key()) as owner:
            tier = SharedTier.open(await owner.describe_tier())
            hashes["src1"] = [os.urandom(32)]
            await fill(owner, tier, ns, hashes["src1"])
            tier.close()
        assert (await pull(sources[0])).pulled == 0, "src2 holds the one arena now: MISS"
        await renewed("src2")
        assert (await pull(sources[0])).pulled == 1
        assert transport.landing_arena("src1") not in (None, first_arena), "a new arena for src1"


def test_the_default_arena_is_an_eighth_of_the_tier_within_256_mib_and_the_tier():
    mib = 1 << 20
    assert DataPlaneConfig(block_bytes=2 * mib, capacity_bytes=4096 * mib).landing_slots == 256  # an eighth
    assert DataPlaneConfig(block_bytes=2 * mib, capacity_bytes=1024 * mib).landing_slots == 128  # 256 MiB
    assert DataPlaneConfig(block_bytes=64 * 1024, capacity_bytes=mib).landing_slots == 16  # the tier
    assert DataPlaneConfig(block_bytes=4096, capacity_bytes=mib, landing_bytes_per_source=8192).landing_slots == 2


async def test_a_renewed_arena_is_a_fresh_one_and_the_old_one_gives_its_pages_back(shm_dir):
    """A source's arena renewed: the next handshake describes another region, the old arena stays mapped (a late
    write lands in memory of this process) with its pages given back (it reads as zeros), and a source is renewed
    at most ``landing_renewals`` times per agent (a rotate starts the count again). Renewals do not count
    against ``max_landing_sources`` (control: another source still gets an arena)."""
    region = SharedRegion(shm_dir / "renew.tier", 4096, 8, owner=True)
    transport = NixlTransport("renew-node", region, landing_slots=2, max_landing_sources=2, landing_renewals=1)
    try:
        await transport.ready(120.0)
        first = read_agent_metadata(transport.landing_metadata("a")).regions
        old = transport.landing_arena("a")
        old.array[:] = 7
        assert not transport.renew_landing_arena("b"), "no arena to renew"
        assert transport.renew_landing_arena("a")
        assert transport.landing_arena("a") is None and (old.array == 0).all(), "its pages went back"
        assert read_agent_metadata(transport.landing_metadata("a")).regions != first
        assert transport.landing_arena("a") is not old
        assert not transport.renew_landing_arena("a"), "renewed once per agent at most"
        transport.landing_metadata("b")  # control: the retired arena takes no source's place
        assert await transport.rotate()
        transport.landing_metadata("a")
        assert transport.renew_landing_arena("a"), "a new agent, a new count"
    finally:
        transport.close()
        region.close()


def test_arena_slots_come_lowest_first_and_go_back():
    arena = LandingArena("src", 6, 4096)
    assert arena.take(4).tolist() == [0, 1, 2, 3]
    arena.give_back(np.array([1, 2]))
    assert arena.take(3).tolist() == [1, 2, 4]
    assert arena.take(3).tolist() == [5], "only what is free"
    assert arena.free_slots == 0
    assert arena.addrs(np.array([0, 5])) == [arena.base_addr, arena.base_addr + 5 * 4096]


def test_the_check_is_of_the_copy_in_the_tier():
    """Blocks copied from an arena into scattered tier slots: all intact, then one changed in the arena (the
    copy carries the change and fails its check at that block), then copying with no check."""
    bb, n = 4096, 12
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, n * bb, dtype=np.uint8)
    expected = [checksum(data[i * bb:(i + 1) * bb]) for i in range(n)]
    arena = LandingArena("src", n, bb)
    landing = arena.take(n)
    arena.array[:] = data
    region = type("Region", (), {"array": np.zeros(2 * n * bb, dtype=np.uint8)})()
    slots = np.array([3, 4, 5, 9, 10, 0, 1, 2, 20, 21, 22, 23])  # runs of consecutive slots, out of order
    checker = RunChecker(region, bb, threads=2)
    assert asyncio.run(checker.first_mismatch(slots, expected, source=(arena.array, landing))) == n
    for i, slot in enumerate(slots):
        assert np.array_equal(region.array[slot * bb:(slot + 1) * bb], data[i * bb:(i + 1) * bb])
    arena.array[7 * bb + 100] ^= 0xFF
    region.array[:] = 0
    assert asyncio.run(checker.first_mismatch(slots, expected, source=(arena.array, landing))) == 7
    assert region.array[slots[7] * bb + 100] == arena.array[7 * bb + 100], "the tier holds the changed byte"
    region.array[:] = 0
    assert asyncio.run(checker.first_mismatch(slots, None, source=(arena.array, landing))) == n
    assert region.array[slots[11] * bb:(slots[11] + 1) * bb].any(), "copied, not checked"


@pytest.mark.parametrize("chunk", [256 << 10, 4 << 20])
def test_copy_and_checksum_is_the_crc_of_what_was_copied(chunk):
    src = np.frombuffer(os.urandom(9 * (1 << 20) + 5), dtype=np.uint8)  # chunks and a ragged end
    dst = np.zeros_like(src)
    assert copy_and_checksum(dst, src, chunk=chunk) == checksum(src)
    assert np.array_equal(dst, src)
    assert copy_and_checksum(dst, src, checksum=False, chunk=chunk) == 0


def test_check_threads_default_to_the_cpus_this_process_may_run_on_at_most_four():
    assert check_threads(3) == 3
    assert check_threads(0) == min(MAX_AUTO_THREADS, len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("threads", [1, 4])
def test_runs_longer_than_a_copy_chunk_are_copied_and_checked_whole(threads):
    """A checker with more than two threads copies 4 MiB at a time: 2 MiB blocks in runs of 3 and 2, intact, then
    one byte changed in the arena near the end of the longest run."""
    bb, n = 2 << 20, 5
    data = np.frombuffer(os.urandom(n * bb), dtype=np.uint8)
    expected = [checksum(data[i * bb:(i + 1) * bb]) for i in range(n)]
    arena = LandingArena("src", n, bb)
    landing = arena.take(n)
    arena.array[:] = data
    region = type("Region", (), {"array": np.zeros(8 * bb, dtype=np.uint8)})()
    slots = np.array([0, 1, 2, 6, 7])
    checker = RunChecker(region, bb, threads=threads)
    assert asyncio.run(checker.first_mismatch(slots, expected, source=(arena.array, landing))) == n
    assert np.array_equal(region.array[6 * bb:], data[3 * bb:])
    arena.array[3 * bb - 1] ^= 0x01
    assert asyncio.run(checker.first_mismatch(slots, expected, source=(arena.array, landing))) == 2
