"""No tenant crowds another out of a node's CPU tier (MemoryTier, data_plane.fair_share), under every built-in eviction
policy, nor out of its disk tier.

A reservation evicts another tenant's blocks only while that tenant holds more than an equal share of the slots
(slots / tenants holding blocks, the asking one counted); its own blocks it may always evict. Before, every policy
ranked all tenants' blocks together, so one tenant's traffic (its engine's saves, its pulls, route-time prefetches
its scheduler or a node key ordered) evicted another's blocks however few it held.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.namespace import CacheConfig, Namespace

from data_plane.disk import DiskTier
from data_plane.eviction import BlockInfo
from data_plane.eviction.registry import BUILTIN, PolicyRegistry
from data_plane.shm import SharedRegion
from data_plane.tier import MemoryTier
from data_plane.types import BlockKey

SLOTS = 8
A, B = (Namespace(t, "tiny-llama", "rev1", CacheConfig(block_size=32)).validate() for t in ("tenant-a", "tenant-b"))


@pytest.fixture(params=sorted(BUILTIN))
def tier(request, shm_dir):
    region = SharedRegion(shm_dir / "fair.tier", 4096, SLOTS, owner=True)
    yield MemoryTier(region, PolicyRegistry().create(request.param, SLOTS), lambda _blocks: None)
    region.close()


def key(ns: Namespace, i: int) -> BlockKey:
    return BlockKey(ns.fingerprint, ns.tenant.encode()[:8].ljust(8, b".") + i.to_bytes(24, "big"))


def store(tier: MemoryTier, ns: Namespace, first: int, n: int) -> int:
    """Reserves and commits blocks ``first``.. of ``ns`` in one run, as a pull does; how many got a slot."""
    keys = [key(ns, i) for i in range(first, first + n)]
    blocks = tier.reserve_run(ns, keys, [BlockInfo()] * n)
    tier.commit_written(blocks, [0] * len(blocks))
    return len(blocks)


def resident(tier: MemoryTier, ns: Namespace, first: int, n: int) -> int:
    return sum(tier.get(key(ns, i)) is not None for i in range(first, first + n))


def test_a_tenant_within_its_share_keeps_its_blocks_whatever_another_stores(tier):
    assert store(tier, A, 0, 3) == 3  # A: 3 of 8 slots, under its share of 4
    for round_ in range(10):  # B stores 40 blocks, 4 at a time, always getting its slots
        assert store(tier, B, 4 * round_, 4) == 4
    assert resident(tier, A, 0, 3) == 3, "B's blocks evicted A's, which held less than its share"
    assert tier.tenant_slots(B.tenant) == SLOTS - 3 and resident(tier, B, 36, 4) == 4  # B evicted its own oldest


def test_one_tenant_alone_has_the_whole_tier_and_a_newcomer_takes_its_share_from_it(tier):
    assert store(tier, B, 0, SLOTS) == SLOTS  # alone: every slot
    assert store(tier, B, SLOTS, 2) == 2  # still alone: evicts its own
    assert store(tier, A, 0, 6) == 4  # a second tenant takes B down to its share (4 of 8), not below
    assert tier.tenant_slots(B.tenant) == 4 and tier.tenant_slots(A.tenant) == 4
    assert store(tier, A, 6, 2) == 2  # A at its share evicts its own blocks
    assert tier.tenant_slots(B.tenant) == 4 and resident(tier, A, 6, 2) == 2



def test_a_newcomer_takes_its_share_from_blocks_the_policy_keeps_last(tier):
    """Found in review: the fair share followed the policy's order, and cost_aware puts protected blocks (a request
    may mark its prefix protected) after every other: with A's blocks all protected, newcomer B evicted only its own
    and stayed at 2 of its 4 slots for good. Below its share a tenant now takes from those over theirs first."""
    keys = [key(A, i) for i in range(SLOTS)]
    tier.commit_written(tier.reserve_run(A, keys, [BlockInfo(protected=True)] * SLOTS), [0] * SLOTS)
    for round_ in range(6):
        store(tier, B, 2 * round_, 2)
    assert tier.tenant_slots(B.tenant) == SLOTS // 2, f"B holds {tier.tenant_slots(B.tenant)} of its share of 4"
    assert tier.tenant_slots(A.tenant) == SLOTS // 2  # and A keeps its own share (control)

def test_pinned_blocks_count_and_are_never_taken(tier):
    assert store(tier, A, 0, 2) == 2
    assert store(tier, B, 0, 6) == 6
    for i in range(6):
        tier.pin(tier.get(key(B, i)))  # B holds 6 > 4, but every one is pinned (readers)
    assert store(tier, A, 2, 4) == 2, "a pinned block was evicted"  # A can only evict its own two
    assert resident(tier, B, 0, 6) == 6


def test_the_disk_tier_shares_the_same_way(tmp_path):
    disk = DiskTier(tmp_path / "fair.disk", 4096, 4, PolicyRegistry().create("lru", 4))
    data = np.zeros(4096, dtype=np.uint8)
    try:
        disk.write(A, key(A, 0), data, 0, BlockInfo())  # A: 1 of 4, under its share of 2
        for i in range(10):
            assert disk.write(B, key(B, i), data, 0, BlockInfo()) is not None
        assert disk.get(key(A, 0)) is not None, "B's demotions evicted A's one block"
        assert [disk.get(key(B, i)) is not None for i in range(7, 10)] == [True] * 3  # B evicted its own oldest
        c = Namespace("tenant-c", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
        disk.write(c, key(c, 0), data, 0, BlockInfo())  # a third tenant (share 1) takes B's, not A's oldest
        assert disk.get(key(A, 0)) is not None and disk.get(key(c, 0)) is not None
        assert sum(disk.get(key(B, i)) is not None for i in range(10)) == 2
    finally:
        disk.close()
