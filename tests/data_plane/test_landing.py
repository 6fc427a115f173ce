"""A WRITE in pieces, each reported landed to the consumer by a NIXL notification, so the consumer checks the
pieces while the rest moves: the pieces cover every block once, in capped descriptors; a report reaches only who
waits for that tag from that sender, after its piece's bytes; a report is a hint of when to check, never a pass
(a block reported before it landed, or corrupt, is still caught); a pull in pieces commits what is intact."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from data_plane.checksum import LandingChecks, RunChecker, checksum
from data_plane.client import DataPlaneClient, SharedTier
from data_plane.transfer import landed_message, lane_pieces
from data_plane.types import LookupStatus

from tests.data_plane.helpers import commit_blocks, nixl_pair

pytestmark = pytest.mark.nixl

BLOCK = 64 * 1024
SLOTS = 48


def blocks_of(descriptors: np.ndarray, length: int) -> list[int]:
    """The block addresses a descriptor list covers, in order."""
    return [int(addr) + k * length for addr, size, _ in descriptors.tolist() for k in range(int(size) // length)]


@pytest.mark.parametrize("lanes", [1, 2, 3])
@pytest.mark.parametrize("piece_blocks", [1, 4, 5, 100])
def test_the_pieces_cover_every_block_once(lanes, piece_blocks):
    length = 16
    rng = np.random.default_rng(lanes * 100 + piece_blocks)
    n = 37
    # runs of consecutive addresses of random lengths on both sides, not the same runs
    local = np.cumsum(np.where(rng.random(n) < 0.2, 3, 1)).astype(np.uint64) * np.uint64(length)
    remote = np.cumsum(np.where(rng.random(n) < 0.3, 5, 1)).astype(np.uint64) * np.uint64(length)
    seen = []
    for lane in lane_pieces(local, remote, length, lanes, b"tag", piece_blocks * length):
        for local_d, remote_d, message in lane:
            prefix, first, count = message.rsplit(b":", 2)
            assert prefix == b"kvmesh-landed:tag"
            first, count = int(first), int(count)
            assert 0 < count <= piece_blocks
            assert blocks_of(local_d, length) == local[first:first + count].tolist()
            assert blocks_of(remote_d, length) == remote[first:first + count].tolist()
            assert np.array_equal(local_d[:, 1], remote_d[:, 1])
            seen += range(first, first + count)
    assert sorted(seen) == list(range(n))
    for untagged in (lane_pieces(local, remote, length, lanes, b"", piece_blocks * length),
                     lane_pieces(local, remote, length, lanes, b"tag", 0)):
        assert [len(lane) for lane in untagged] == [1] * lanes and all(m == b"" for lane in untagged
                                                                        for *_, m in lane)


@pytest.fixture
async def pair(shm_dir, monkeypatch):
    async with nixl_pair(shm_dir, monkeypatch, "l", BLOCK, SLOTS, piece_bytes=5 * BLOCK) as transports:
        yield transports


async def test_each_piece_is_reported_after_its_bytes_landed_and_only_to_its_waiter(pair):
    src, dst, (src_region, dst_region) = pair
    peer = src.add_peer(dst.metadata())
    src_region.array[:] = np.random.default_rng(1).integers(0, 256, src_region.array.size, dtype=np.uint8)
    offsets = [src_region.offset(s) for s in range(SLOTS)]
    remote = [dst_region.base_addr + dst_region.offset(s) for s in range(SLOTS)]
    reports, others = [], []

    def on_landed(first: int, count: int) -> None:  # the piece's bytes must be there when its report is read
        intact = all(np.array_equal(dst_region.slot(s), src_region.slot(s)) for s in range(first, first + count))
        reports.append((first, count, intact))

    with dst.landed(src.agent_name, b"lease-1", on_landed), \
            dst.landed(src.agent_name, b"lease-2", lambda f, c: others.append((f, c))), \
            dst.landed("another-agent", b"lease-1", lambda f, c: others.append((f, c))):
        await src.write(peer, offsets, remote, BLOCK, 30.0, tag=b"lease-1")
        for _ in range(1000):
            if sum(c for _, c, _ in reports) == SLOTS:
                break
            await asyncio.sleep(0.01)
    assert sorted(f for f, _, _ in reports) == list(range(0, SLOTS, 5)) and sum(c for _, c, _ in reports) == SLOTS
    assert all(intact for *_, intact in reports), reports
    assert others == []  # another tag, another sender: not told

    # a report never takes the place of a handshake's challenge from the same sender
    src.notify(peer, b"nonce")
    src.notify(peer, landed_message(b"lease-3", 0, 1))
    src.notify(peer, b"kvmesh-landed:lease-3:not-a-number")
    late = []
    with dst.landed(src.agent_name, b"lease-3", lambda f, c: late.append((f, c))):
        for _ in range(1000):
            if late:
                break
            await asyncio.sleep(0.01)
    assert late == [(0, 1)]
    assert await dst.notification(src.agent_name, 10.0) == b"nonce"


class CountingChecker(RunChecker):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.checked = 0  # blocks checked, in all

    async def first_mismatch(self, slots, expected, threads: int = 0, source=None) -> int:
        self.checked += len(slots)
        return await super().first_mismatch(slots, expected, threads, source)


def landing(n: int = 24, block_bytes: int = 4096):
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n * block_bytes, dtype=np.uint8)
    region = SimpleNamespace(array=np.zeros(n * block_bytes, dtype=np.uint8))  # nothing landed yet
    slots = np.arange(n)[::-1].copy()  # block i lands in slot n - 1 - i
    expected = [checksum(data[i * block_bytes:(i + 1) * block_bytes]) for i in range(n)]

    def land(first: int, count: int) -> None:
        for i in range(first, first + count):
            region.array[slots[i] * block_bytes:(slots[i] + 1) * block_bytes] = \
                data[i * block_bytes:(i + 1) * block_bytes]

    return CountingChecker(region, block_bytes, 2), slots, expected, land, region


async def test_pieces_checked_as_they_land_are_not_checked_again():
    checker, slots, expected, land, _ = landing()
    checks = LandingChecks(checker, slots, expected)
    for first in range(0, 24, 8):
        land(first, 8)
        checks.landed(first, 8)
    assert await checks.first_mismatch(24) == 24
    assert checker.checked == 24  # each block once: the end of the WRITE found nothing left to check


async def test_a_report_before_the_bytes_landed_is_checked_again_and_never_passes_a_block():
    checker, slots, expected, land, _ = landing()
    checks = LandingChecks(checker, slots, expected)
    checks.landed(0, 24)  # reported (a spoofed or early notification) before any byte landed: fails
    checks.landed(-1, 3)  # outside the pull's blocks: ignored
    checks.landed(20, 10)
    await asyncio.sleep(0.2)
    land(0, 24)
    assert await checks.first_mismatch(24) == 24  # checked again once the WRITE ended: all intact
    assert checker.checked == 48


async def test_a_corrupt_block_is_caught_whether_its_piece_was_reported_or_not():
    for reported in (True, False):
        checker, slots, expected, land, region = landing()
        checks = LandingChecks(checker, slots, expected)
        land(0, 24)
        region.array[slots[13] * 4096 + 7] ^= 1  # block 13 arrived corrupt
        if reported:
            checks.landed(8, 8)
            checks.landed(16, 8)
        assert await checks.first_mismatch(24) == 13
        assert await checks.first_mismatch(13) == 13  # the WRITE of fewer blocks: what it covers is intact


async def test_a_pull_in_pieces_commits_the_intact_blocks_before_a_corrupt_one(local_node, ns, grant, monkeypatch):
    """The source WRITEs 12 blocks in pieces of 3; its block 8 changed after its CRC was taken: blocks 0-7 are
    committed with their bytes, 8 onwards are MISS. The consumer checked pieces as they landed (control: reports
    reached it)."""
    reported = []
    real_landed = LandingChecks.landed
    monkeypatch.setattr(LandingChecks, "landed", lambda self, f, c: (reported.append((f, c)), real_landed(self, f, c)))
    source = await local_node(node_id="src", block_bytes=BLOCK, capacity_bytes=16 * BLOCK,
                              transfer_piece_bytes=3 * BLOCK)
    consumer = await local_node(node_id="dst", block_bytes=BLOCK, capacity_bytes=16 * BLOCK,
                                transfer_piece_bytes=3 * BLOCK)
    async with DataPlaneClient(source.address, key=source.core.config.node_key()) as owner, \
            DataPlaneClient(consumer.address, key=consumer.core.config.node_key()) as local:
        hashes = await commit_blocks(owner, ns, 12)  # block i is all i + 1
        src_tier = SharedTier.open(await owner.describe_tier())
        slots, lease = await owner.acquire(ns, hashes[8:9])
        src_tier.slot(slots[0])[100] ^= 0xFF
        await owner.release(lease)
        src_tier.close()
        token = grant((await local.describe_tier()).peer_public_key, "dst", "src", ns)
        result = await local.pull(ns, hashes, "src", source.address, grant=token, timeout_ms=60_000)
        assert result.statuses == [LookupStatus.HIT] * 8 + [LookupStatus.MISS] * 4
        dst_tier = SharedTier.open(await local.describe_tier())
        got, lease = await local.acquire(ns, hashes)
        assert len(got) == 8 and all(np.all(dst_tier.slot(s) == i + 1) for i, s in enumerate(got))
        await local.release(lease)
        dst_tier.close()
    assert reported and all(c <= 3 for _, c in reported)
