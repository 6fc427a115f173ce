"""A promotion from the disk tier obeys the tenant's CPU-tier limit on the node, as a Reserve or a pull does: a
block that would take the tenant past it stays on disk (the caller gets a MISS for it). One in-process node over
real gRPC, with shared-memory and disk tiers; the limit is the one the node last learned for the tenant (here
handed to Reserve, as the servicer does with the control plane's answer)."""

from __future__ import annotations

from kvmesh.namespace import CacheConfig, Namespace

from data_plane.client import DataPlaneClient
from data_plane.epochs import GONE
from data_plane.types import BlockKey, Medium

from tests.data_plane.test_local_api import BLOCK_BYTES, make_hashes

OTHER = Namespace("tenant-other", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
EVERY_TIER = [Medium.CPU, Medium.DISK]


async def test_a_promotion_from_disk_stays_within_the_tenants_limit(local_node, ns, tmp_path):
    node = await local_node(capacity_bytes=4 * BLOCK_BYTES, disk_dir=tmp_path, disk_capacity_bytes=8 * BLOCK_BYTES)
    core = node.core

    def store(namespace: Namespace, hashes: list[bytes], tenant_limit_bytes: int | None) -> None:
        assert -1 not in core.reserve(namespace, hashes, tenant_limit_bytes=tenant_limit_bytes)
        assert core.commit(namespace, hashes) == len(hashes)

    on_disk, in_cpu = make_hashes(2), make_hashes(4)
    store(ns, on_disk, None)
    store(ns, in_cpu, None)  # fills the CPU tier: the tenant's first two blocks go to disk
    assert all(core.disk.get(BlockKey(ns.fingerprint, h)) for h in on_disk)
    store(OTHER, make_hashes(1), None)  # another tenant takes one of its slots (it held more than its share, 2)
    assert core.tier.tenant_slots(ns.tenant) == 3
    async with DataPlaneClient(node.address, key=core.config.node_key()) as client:
        core.reserve(ns, in_cpu[1:], tenant_limit_bytes=3 * BLOCK_BYTES)  # the tenant is at its limit (stored already)
        slots, lease = await client.acquire(ns, on_disk, media=EVERY_TIER)
        assert slots == [] and not lease, "a promotion took the tenant past its limit"
        assert core.tier.tenant_slots(ns.tenant) == 3
        # Control: with room for one more block under a raised limit, one block is promoted, not two (the other
        # tenant deleted: its slot is free).
        core.learn_epoch(OTHER.tenant, GONE)
        core.reserve(ns, in_cpu[1:], tenant_limit_bytes=4 * BLOCK_BYTES)
        slots, lease = await client.acquire(ns, on_disk, media=EVERY_TIER)
        assert len(slots) == 1 and core.tier.tenant_slots(ns.tenant) == 4
        await client.release(lease)
