"""A call that stops half-way keeps no pin, and a promotion from a full disk does not evict what it promotes (a real
in-process data plane; the first over real gRPC with a grant and a peer's proofs).

Found in review: a peer Lookup pinned its CPU HITs, then waited for the pending ones, and only then cut its node's
pins to the share and put them under a lease; a call cut off while it waited (its deadline, or its client's
cancel) left every pin in place with no lease to end it. One node key naming a tenant's blocks and one block still
being written, with a short deadline, pinned more than its share for good and kept other tenants off the node until
a restart. A local Acquire cancelled while its check ran did the same. And a promotion from disk reserved its CPU
slot first: with both tiers full, the reservation evicted a CPU block to disk, which evicted the disk's oldest
block, often the one being promoted; its read then raised KeyError, the reserved slot stayed ALLOCATED for good
(that block pending forever) and the lookup's earlier pins leaked.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from kvmesh.namespace import Namespace

from data_plane.client import DataPlaneClient
from data_plane.tier import BlockState
from data_plane.types import BlockKey, LookupStatus, Medium
from tenancy.peer_proof import NodeIdentity

SLOTS = 16  # the config fixture's tier
BLOCK_BYTES = 64 * 1024  # its slot size
EVERY_TIER = frozenset([Medium.CPU, Medium.DISK])


def pins(core, ns: Namespace, hashes: list[bytes]) -> int:
    return sum(block.pins for h in hashes if (block := core.tier.get(BlockKey(ns.fingerprint, h))) is not None)


async def test_a_peer_lookup_cut_off_while_it_waits_keeps_no_pin(local_node, ns, grant):
    node = await local_node(node_id="src")
    core = node.core
    tenant_b = Namespace("tenant-b", ns.model, ns.weight_version, ns.cache_config).validate()
    b_blocks = [os.urandom(32) for _ in range(SLOTS - 1)]
    writing = [os.urandom(32)]
    async with DataPlaneClient(node.address, key=core.config.node_key()) as owner:
        assert min(await owner.reserve(tenant_b, b_blocks)) >= 0
        assert await owner.commit(tenant_b, b_blocks) == SLOTS - 1
        assert min(await owner.reserve(tenant_b, writing)) >= 0  # B's engine is still writing this one: pending
        attacker = NodeIdentity()  # one node key B's policy allows
        token = grant(attacker.public_key, "node-x", "src", tenant_b)
        async with DataPlaneClient(node.address, peer_proof=lambda g, m: attacker.proof(g, m, "src")) as peer:
            for part in (b_blocks[:8], b_blocks[8:]):
                with pytest.raises(grpc.aio.AioRpcError) as cut:
                    await peer.lookup(tenant_b, part + writing, pending_wait_ms=5000, lease_ms=60_000, grant=token,
                                      timeout=0.3)
                assert cut.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.5)  # the server's handler is cancelled
            assert pins(core, tenant_b, b_blocks) == 0, "a lookup cut off while it waited left its pins"
            slots = await owner.reserve(ns, [os.urandom(32) for _ in range(6)])
            assert min(slots) >= 0, f"tenant A was kept off the node: {slots}"
            await owner.abort(tenant_b, writing)
            # control: the same lookup, let finish, pins its node's share under a lease, which ends it
            kept = [h for h in b_blocks if core.tier.get(BlockKey(tenant_b.fingerprint, h)) is not None]
            answer, _ = await peer.lookup(tenant_b, kept, lease_ms=60_000, grant=token)
            assert answer.statuses.count(LookupStatus.HIT) > 0 and pins(core, tenant_b, b_blocks) > 0
            await peer.release(answer.lease_id, grant=token)
            assert pins(core, tenant_b, b_blocks) == 0


async def test_a_local_acquire_cancelled_in_its_check_keeps_no_pin(local_node, ns):
    core = (await local_node()).core
    hashes = [os.urandom(32) for _ in range(8)]
    assert -1 not in core.reserve(ns, hashes) and core.commit(ns, hashes) == len(hashes)
    started = asyncio.Event()
    checker = core._checker
    check = checker.first_mismatch

    async def slow_check(slots, checksums):
        started.set()
        await asyncio.sleep(10)
        return await check(slots, checksums)

    checker.first_mismatch = slow_check
    task = asyncio.create_task(core.acquire(ns, hashes, EVERY_TIER))
    await started.wait()
    assert pins(core, ns, hashes) == len(hashes)  # control: pinned while the check runs
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pins(core, ns, hashes) == 0, "an Acquire cancelled in its check left its pins"


def older_and_newer(core, ns: Namespace) -> tuple[list[bytes], list[bytes]]:
    """Four blocks stored, then four more into a CPU tier of four: the older demoted to disk, the newer in the CPU
    tier (newer[0] its next victim)."""
    older, newer = [os.urandom(32) for _ in range(4)], [os.urandom(32) for _ in range(4)]
    for hashes in (older, newer):
        assert -1 not in core.reserve(ns, hashes) and core.commit(ns, hashes) == len(hashes)
    return older, newer


async def test_a_promotion_onto_a_full_disk_keeps_its_own_block(local_node, ns, tmp_path):
    core = (await local_node(capacity_bytes=4 * BLOCK_BYTES, disk_dir=tmp_path,
                             disk_capacity_bytes=4 * BLOCK_BYTES)).core

    older, newer = older_and_newer(core, ns)
    assert len(core.disk) == core.disk.num_slots and all(core.disk.get(BlockKey(ns.fingerprint, h)) for h in older)
    ask = [newer[3], older[0]]  # older[0]: the disk's oldest, promoted into a full CPU tier (a peer's share: 2)
    answer = await core.lookup(ns, ask, media=EVERY_TIER, holder="peer:x:k", grant_epoch="", peer_node="x")
    assert answer.statuses == [LookupStatus.HIT] * 2, answer.statuses
    promoted = core.tier.get(BlockKey(ns.fingerprint, older[0]))
    assert promoted is not None and promoted.state is BlockState.COMMITTED
    core.release(answer.lease_id)
    assert pins(core, ns, ask) == 0
    slots, lease = await core.acquire(ns, [older[0]], EVERY_TIER)  # control: an engine reads it
    assert slots == [promoted.slot]
    core.release(lease)


async def test_a_promotion_that_evicts_a_later_block_of_the_same_lookup_leaks_nothing(local_node, ns, tmp_path):
    """Found in review: the lookup walked a snapshot of the tier taken before it started; promoting the prefix's
    head from disk evicted the next block, which the snapshot still showed: it was pinned, the policy raised
    KeyError for it, and the blocks pinned before stayed pinned for good. Control: the promoted head is a HIT."""
    core = (await local_node(capacity_bytes=4 * BLOCK_BYTES, disk_dir=tmp_path,
                             disk_capacity_bytes=8 * BLOCK_BYTES)).core

    older, newer = older_and_newer(core, ns)
    ask = [older[0], newer[0], newer[1]]  # a prefix whose head was demoted
    answer = await core.lookup(ns, ask, media=EVERY_TIER)
    assert answer.statuses[0] is LookupStatus.HIT, answer.statuses
    core.release(answer.lease_id)
    assert pins(core, ns, ask + older + newer) == 0, "a block stayed pinned with no lease"
