"""The CPU tier's block lifecycle, pins and eviction, and the lease table (fake clock)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.errors import FailedPrecondition

from data_plane.eviction import BlockInfo
from data_plane.eviction.lru import LruPolicy
from data_plane.leases import LeaseTable
from data_plane.shm import RegionBusy, SharedRegion
from data_plane.tier import BlockState, MemoryTier
from data_plane.types import BlockKey


@pytest.fixture
def region(shm_dir):
    r = SharedRegion(shm_dir / "t.tier", 4096, 4, owner=True)
    yield r
    r.close()


@pytest.fixture
def evicted():
    return []


@pytest.fixture
def tier(region, evicted):
    return MemoryTier(region, LruPolicy(4), evicted.extend)


def key(i: int) -> BlockKey:
    return BlockKey("ns", bytes([i]) * 32)


def committed(tier, ns, i):
    block = tier.reserve(ns, key(i), BlockInfo())
    tier.mark_written(block, 0)
    tier.commit(block)
    return block


def test_lifecycle_moves_forward_only(tier, ns):
    block = tier.reserve(ns, key(1), BlockInfo())
    assert block.state is BlockState.ALLOCATED and not block.committed
    with pytest.raises(FailedPrecondition, match="allocated, expected written"):
        tier.commit(block)
    tier.mark_written(block, 123)
    tier.commit(block)
    assert block.committed and tier.get(key(1)) is block
    with pytest.raises(FailedPrecondition, match="cannot be aborted"):
        tier.abort(block)
    assert tier.reserve(ns, key(1), BlockInfo()) is None  # already present


def test_abort_frees_the_slot(tier, ns):
    block = tier.reserve(ns, key(1), BlockInfo())
    tier.abort(block)
    assert tier.get(key(1)) is None and tier.free_slots == 4


def test_pinned_blocks_are_never_evicted(tier, ns, evicted):
    blocks = [committed(tier, ns, i) for i in range(4)]
    for b in blocks[:3]:
        tier.pin(b)
    assert tier.reserve(ns, key(9), BlockInfo()) is not None
    assert evicted == [blocks[3]]
    # every slot pinned or uncommitted: nothing to evict
    assert tier.reserve(ns, key(10), BlockInfo()) is None
    tier.unpin(blocks[0])
    with pytest.raises(FailedPrecondition, match="not pinned"):
        tier.unpin(blocks[3])


def test_uncommitted_blocks_are_not_evictable(tier, ns):
    for i in range(4):
        tier.reserve(ns, key(i), BlockInfo())
    assert tier.reserve(ns, key(9), BlockInfo()) is None


async def test_wait_settled_sees_commit_and_times_out(tier, ns):
    block = tier.reserve(ns, key(1), BlockInfo())
    assert await tier.wait_settled(block, 0.02) is False

    async def commit_later():
        await asyncio.sleep(0.01)
        tier.mark_written(block, 0)
        tier.commit(block)

    task = asyncio.create_task(commit_later())
    assert await tier.wait_settled(block, 2.0) is True
    await task
    other = tier.reserve(ns, key(2), BlockInfo())
    asyncio.get_running_loop().call_later(0.01, tier.abort, other)
    assert await tier.wait_settled(other, 2.0) is False


def test_second_owner_of_a_region_is_refused(region):
    with pytest.raises(RegionBusy, match="owned by another running data plane"):
        SharedRegion(region.path, 4096, 4, owner=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_leases_expire_and_release_is_idempotent():
    clock = FakeClock()
    table: LeaseTable[str] = LeaseTable(clock)
    a = table.grant("peer-1", ["x"], ttl_s=1.0)
    b = table.grant("peer-2", ["y"], ttl_s=5.0)
    clock.now += 2.0
    assert [lease.lease_id for lease in table.expire()] == [a]
    assert table.release(a) == []
    assert table.release(b) == ["y"] and table.release(b) == []
    assert len(table) == 0


def test_a_lease_is_taken_only_by_its_holder_in_its_scope_before_it_expires():
    clock = FakeClock()
    table: LeaseTable[str] = LeaseTable(clock)
    lease = table.grant("peer-1", ["x", "y"], ttl_s=1.0, scope="ns-a")
    assert table.take(lease, "peer-2", "ns-a") is None  # another holder
    assert table.take(lease, "peer-1", "ns-b") is None  # another scope
    assert table.take("0" * 32, "peer-1", "ns-a") is None  # no such lease
    assert len(lease) == 32 and len(table) == 1  # 128 random bits; the refusals left it alone
    taken = table.take(lease, "peer-1", "ns-a")
    assert taken is not None and taken.items == ["x", "y"] and len(table) == 0  # control: its holder, its scope
    assert table.take(lease, "peer-1", "ns-a") is None  # once
    late = table.grant("peer-1", ["z"], ttl_s=1.0, scope="ns-a")
    clock.now += 1.0
    assert table.take(late, "peer-1", "ns-a") is None  # expired (not swept yet): the sweep unpins it
    assert [expired.lease_id for expired in table.expire()] == [late]


def test_a_run_reserved_after_evictions_takes_its_slots_in_ascending_order(tier, ns, evicted):
    """The victims' slots come back oldest first; a pull's run gets them ascending, so its landing slots stay one
    run (one NIXL descriptor, one CRC call) instead of one per block. Control: a fresh tier hands out 0, 1, ..."""
    first = tier.reserve_run(ns, [key(i) for i in range(4)], [BlockInfo()] * 4)
    assert [b.slot for b in first] == [0, 1, 2, 3]
    for block in first:
        tier.mark_written(block, 0)
        tier.commit(block)
    second = tier.reserve_run(ns, [key(i) for i in range(10, 14)], [BlockInfo()] * 4)
    assert [b.slot for b in evicted] == [0, 1, 2, 3]  # evicted oldest first
    assert [b.slot for b in second] == [0, 1, 2, 3]
    assert [tier.get(key(i)) for i in range(10, 14)] == second
