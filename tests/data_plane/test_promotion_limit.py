"""A promotion from the disk tier obeys the tenant's CPU-tier limit on the node, as a Reserve or a pull does: a
block that would take the tenant past it stays on disk (the caller gets a MISS for it). One in-process node over
real gRPC, with shared-memory and disk tiers; the limit is the one the node last learned for the tenant (here
handed to Reserve, as the servicer does with the control plane's answer)."""

from __future__ import annotations

from kvmesh.namespace import CacheConfig, Namespace

from data_plane.client import DataPlaneClient
from data_plane.types import BlockKey, Medium

from tests.data_plane.test_local_api import BLOCK_BYTES, make_hashes

OTHER = Namespace("tenant-other", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
EVERY_TIER = [Medium.CPU, Medium.DISK]


async def test_a_promotion_from_disk_stays_within_the_tenants_limit(local_node, ns, tmp_path):
    node = await local_node(capacity_bytes=4 * BLOCK_BYTES, disk_dir=tmp_path, disk_capacity_bytes=8 * BLOCK_BYTES)
    core = node.core
    limit = 2 * BLOCK_BYTES

    def store(namespace: Namespace, hashes: list[bytes], tenant_limit_bytes: int | None) -> None:
        assert -1 not in core.reserve(namespace, hashes, tenant_limit_bytes=tenant_limit_bytes)
        assert core.commit(namespace, hashes) == len(hashes)

    on_disk, in_cpu = make_hashes(2), make_hashes(2)
    store(ns, on_disk, limit)
    store(OTHER, make_hashes(4), None)  # fills the CPU tier: the tenant's two blocks go to disk
    assert core.tier.tenant_slots(ns.tenant) == 0 and all(core.disk.get(BlockKey(ns.fingerprint, h)) for h in on_disk)
    store(ns, in_cpu, limit)  # the tenant is at its limit in the CPU tier again
    async with DataPlaneClient(node.address, key=core.config.node_key()) as client:
        slots, lease = await client.acquire(ns, on_disk, media=EVERY_TIER)
        assert slots == [] and not lease, "a promotion took the tenant past its limit"
        assert core.tier.tenant_slots(ns.tenant) == 2
        # Control: with room for one more block under a raised limit, one block is promoted, not two.
        core.reserve(ns, in_cpu, tenant_limit_bytes=3 * BLOCK_BYTES)  # (stored already: only the limit is news)
        slots, lease = await client.acquire(ns, on_disk, media=EVERY_TIER)
        assert len(slots) == 1 and core.tier.tenant_slots(ns.tenant) == 3
        await client.release(lease)
