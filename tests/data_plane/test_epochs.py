"""Tenant epochs in the data plane (data_plane.epochs): blocks are tagged with the epoch the node knew when they
were stored, served only under that epoch, and dropped from every tier when the epoch changes.

One in-process node over real gRPC (NIXL agent, shared-memory and disk tiers), no control plane: the test hands
the node the control plane's answers (``learn_epoch``, what NodeAuth does on each GetTenantLimits answer).
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvmesh.namespace import CacheConfig, Namespace
from tenancy.grants import Grant
from tenancy.peer_proof import NodeIdentity, encode_public_key

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.epochs import GONE, TenantEpochs
from data_plane.types import LookupStatus, Medium

from tests.data_plane.test_local_api import BLOCK_BYTES, RecordingSink, make_hashes

B = Namespace("tenant-b", "tiny-llama", "rev1", CacheConfig(block_size=32)).validate()
EVERY_TIER = [Medium.CPU, Medium.DISK]


def test_a_block_is_served_only_under_its_own_epoch():
    epochs = TenantEpochs()
    assert epochs.current("t") == ""  # never told: only blocks stored while not told are served
    assert epochs.serves("", epochs.current("t"))
    assert epochs.learn("t", "e1") and not epochs.learn("t", "e1")
    assert epochs.serves("e1", epochs.current("t"))
    assert not epochs.serves("", epochs.current("t"))  # stored before the node knew: dropped, not served
    assert epochs.learn("t", "e2")
    assert not epochs.serves("e1", epochs.current("t"))  # negative control: the predecessor's tag
    assert epochs.learn("t", GONE) and not epochs.serves("e2", epochs.current("t"))
    assert not epochs.serves("", GONE)
    assert epochs.current("other") == ""  # per tenant


async def store(client: DataPlaneClient, tier: SharedTier, ns: Namespace, hashes: list[bytes]) -> int:
    for slot in await client.reserve(ns, hashes):
        assert slot >= 0
        tier.slot(slot)[:] = np.full(BLOCK_BYTES, 7, dtype=np.uint8)
    return await client.commit(ns, hashes)


async def found(client: DataPlaneClient, ns: Namespace, hashes: list[bytes]) -> int:
    """How many leading blocks a local Acquire finds (from either tier); releases them."""
    slots, lease = await client.acquire(ns, hashes, media=EVERY_TIER)
    if lease:
        await client.release(lease)
    return len(slots)


async def test_a_new_epoch_drops_the_old_blocks_from_every_tier(local_node, ns, tmp_path, grant):
    node = await local_node(capacity_bytes=2 * BLOCK_BYTES, disk_dir=tmp_path, disk_capacity_bytes=8 * BLOCK_BYTES)
    sink = node.core.events = RecordingSink()
    peer_id = NodeIdentity()
    old_grant = grant(peer_id.public_key, "consumer", node.core.node_id, ns)  # no epoch: the node's "" too
    on_disk, in_cpu, other = make_hashes(1), make_hashes(1), make_hashes(1)
    async with DataPlaneClient(node.address, key=node.core.config.node_key()) as client, \
            DataPlaneClient(node.address, peer_proof=lambda g, m: peer_id.proof(g, m, node.core.node_id)) as peer:
        tier = SharedTier.open(await client.describe_tier())
        for hashes in (on_disk, in_cpu):
            assert await store(client, tier, ns, hashes) == 1
        assert await store(client, tier, B, other) == 1  # evicts on_disk to the disk tier
        assert ("stored", ns.fingerprint, on_disk, Medium.DISK) in sink.events
        # Positive control: the tenant's blocks are there, for the engine and for a peer with a grant.
        assert await found(client, ns, in_cpu) == 1
        answer, _ = await peer.lookup(ns, in_cpu, grant=old_grant)
        assert answer.statuses == [LookupStatus.HIT]
        await peer.release(answer.lease_id, grant=old_grant)
        reader, lease = await client.acquire(ns, in_cpu)  # a reader still holds this one when the epoch changes
        assert reader

        node.core.learn_epoch(ns.tenant, "e2")  # the control plane: the tenant was re-created

        assert ("removed", ns.fingerprint, in_cpu, Medium.CPU) in sink.events
        assert ("removed", ns.fingerprint, on_disk, Medium.DISK) in sink.events
        assert await found(client, ns, in_cpu) == 0 and await found(client, ns, on_disk) == 0
        answer, _ = await peer.lookup(ns, in_cpu + on_disk, grant=old_grant)
        assert answer.statuses == [LookupStatus.MISS] * 2
        assert await found(client, B, other) == 1  # another tenant's blocks stay
        # The pinned block's slot comes back when its reader lets go (B's block is the only other one here).
        assert sum(s >= 0 for s in await client.reserve(B, make_hashes(2))) == 1
        await client.release(lease)
        assert sum(s >= 0 for s in await client.reserve(B, make_hashes(1))) == 1

        node.core.learn_epoch(ns.tenant, GONE)  # deleted
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.reserve(ns, make_hashes(1))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        tier.close()


async def test_a_write_reserved_under_an_ended_epoch_is_not_published(local_node, ns):
    node = await local_node()
    sink = node.core.events = RecordingSink()
    async with DataPlaneClient(node.address, key=node.core.config.node_key()) as client:
        tier = SharedTier.open(await client.describe_tier())
        kept, late = make_hashes(1), make_hashes(1)
        node.core.learn_epoch(ns.tenant, "e1")
        assert await store(client, tier, ns, kept) == 1  # positive control: the current epoch's write commits
        assert await found(client, ns, kept) == 1
        slots = await client.reserve(ns, late)
        tier.slot(slots[0])[:] = 1
        node.core.learn_epoch(ns.tenant, "e2")
        assert await client.commit(ns, late) == 0
        assert not any(e[0] == "stored" and e[2] == late for e in sink.events)
        assert await found(client, ns, late) == 0
        assert await store(client, tier, ns, late) == 1  # stored again under e2: served
        assert await found(client, ns, late) == 1
        tier.close()


async def test_blocks_committed_before_the_epoch_was_known_are_dropped_loudly_not_silently(local_node, ns, caplog):
    """A node that has never heard the tenant's epoch (the control plane hung on its first ask) tags what it
    stores "" and drops it once the epoch arrives: those blocks could be a deleted predecessor's (same tenant id),
    and nothing says they are not. The loss is bounded (only what was committed before the first answer; blocks
    stored afterwards stay) and reported: a warning naming the cause, BlockRemoved, and its own counter."""
    node = await local_node()
    sink = node.core.events = RecordingSink()
    registry = node.core.metrics.registry
    async with DataPlaneClient(node.address, key=node.core.config.node_key()) as client:
        tier = SharedTier.open(await client.describe_tier())
        early = make_hashes(3)
        assert await store(client, tier, ns, early) == 3  # no epoch known yet
        assert await found(client, ns, early) == 3
        with caplog.at_level("WARNING", logger="data_plane.core"):
            node.core.learn_epoch(ns.tenant, "e1")  # the control plane answers at last
        assert await found(client, ns, early) == 0
        assert ("removed", ns.fingerprint, early, Medium.CPU) in sink.events
        assert registry.get_sample_value("kvmesh_dp_unknown_epoch_blocks_dropped_total") == 3
        assert any("committed before this node knew the tenant's epoch" in r.getMessage() for r in caplog.records)
        later = make_hashes(2)
        assert await store(client, tier, ns, later) == 2
        node.core.learn_epoch(ns.tenant, "e1")  # the same answer again: nothing more goes
        assert await found(client, ns, later) == 2
        assert registry.get_sample_value("kvmesh_dp_unknown_epoch_blocks_dropped_total") == 3
        tier.close()


async def test_a_lookup_of_only_committed_blocks_serves_a_grant_of_their_epoch_only(local_node, ns, grant_signer):
    """The Lookup of a request whose blocks are all committed in the CPU tier (answered in native loops, not a
    step per block) checks their epoch too: a grant of another epoch of the tenant gets MISS for each."""
    node = await local_node()
    node.core.learn_epoch(ns.tenant, "e1")
    peer_id = NodeIdentity()

    def signed(epoch: str) -> bytes:
        return grant_signer.sign(Grant(ns.tenant, ns.fingerprint, "consumer", encode_public_key(peer_id.public_key),
                                       node.core.node_id, int(time.time() * 1000) + 60_000, tenant_epoch=epoch))

    hashes = make_hashes(4)
    async with DataPlaneClient(node.address, key=node.core.config.node_key()) as client, \
            DataPlaneClient(node.address, peer_proof=lambda g, m: peer_id.proof(g, m, node.core.node_id)) as peer:
        tier = SharedTier.open(await client.describe_tier())
        assert await store(client, tier, ns, hashes) == 4
        answer, _ = await peer.lookup(ns, hashes, grant=signed("e1"))  # positive control: its own epoch
        assert answer.statuses == [LookupStatus.HIT] * 4
        await peer.release(answer.lease_id, grant=signed("e1"))
        for other in ("", "e0"):
            answer, _ = await peer.lookup(ns, hashes, grant=signed(other))
            assert answer.statuses == [LookupStatus.MISS] * 4 and not answer.lease_id, other
        tier.close()
