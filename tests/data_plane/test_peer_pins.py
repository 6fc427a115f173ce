"""One peer's pins cannot keep a tenant out of a node (a real in-process data plane, real gRPC, peers with grants
and proofs; data_plane.tier.MemoryTier.peer_pin_share).

Found in review: a peer Lookup pins its HITs for up to max_lease_ms (60 s), eviction never takes a pinned block,
and nothing bounded how many one peer pinned: whoever held one node key a tenant allows could pin all of that
tenant's blocks on a node, renew every lease before it ran out, and keep every other tenant's reservations at -1
(the fair share could evict nothing). A peer's live leases now hold at most an equal share of the node's slots of
one tenant's blocks (half at most), so a tenant over its share always keeps unpinned blocks a newcomer may evict.
"""

from __future__ import annotations

import os

from kvmesh.namespace import Namespace

from data_plane.client import DataPlaneClient
from data_plane.leases import LeaseTable
from data_plane.types import LookupStatus
from tenancy.peer_proof import NodeIdentity

SLOTS = 16  # the config fixture's tier


class Clock:
    now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_a_groups_count_follows_its_live_leases():
    clock = Clock()
    leases: LeaseTable[int] = LeaseTable(clock)
    first = leases.grant("peer:x:key1", [1, 2, 3], 10, group="x/b")
    second = leases.grant("peer:x:key2", [4], 5, group="x/b")  # another holder of the same group counts with it
    leases.grant("peer:x:key1", [5, 6], 10, group="x/a")
    leases.grant("local", [7], 10)  # no group: not counted
    assert (leases.held("x/b"), leases.held("x/a"), leases.held("y/b")) == (4, 2, 0)
    assert leases.take(first, "peer:x:key1", "") is not None and leases.held("x/b") == 1  # taken by a send
    clock.now = 6
    assert [lease.lease_id for lease in leases.expire()] == [second] and leases.held("x/b") == 0
    assert leases.release(first) == [] and leases.held("x/b") == 0  # ended once, counted once


async def test_one_peer_cannot_pin_a_tenant_out_of_a_node(local_node, ns, grant):
    node = await local_node(node_id="src")
    tenant_b = Namespace("tenant-b", ns.model, ns.weight_version, ns.cache_config).validate()
    b_blocks = [os.urandom(32) for _ in range(SLOTS)]
    async with DataPlaneClient(node.address, key=node.core.config.node_key()) as owner:
        assert min(await owner.reserve(tenant_b, b_blocks)) >= 0
        assert await owner.commit(tenant_b, b_blocks) == SLOTS  # tenant B alone fills the tier
        attacker = NodeIdentity()  # one node key B's policy allows: grants for B's namespace
        token = grant(attacker.public_key, "node-x", "src", tenant_b)
        async with DataPlaneClient(node.address, peer_proof=lambda g, m: attacker.proof(g, m, "src")) as peer:
            answer, _ = await peer.lookup(tenant_b, b_blocks, lease_ms=60_000, grant=token)
            statuses = answer.statuses
            assert statuses == [LookupStatus.HIT] * (SLOTS // 2) + [LookupStatus.MISS] * (SLOTS // 2), \
                "one peer pinned more than half the node"  # control: the leading half is served
            again, _ = await peer.lookup(tenant_b, b_blocks[SLOTS // 2:], lease_ms=60_000, grant=token)
            assert LookupStatus.HIT not in again.statuses  # another lease adds nothing past the share
            newcomer = [os.urandom(32) for _ in range(6)]
            slots = await owner.reserve(ns, newcomer)  # tenant A's engine saves on this node
            assert min(slots) >= 0, f"tenant A was kept out of the node: {slots}"
            await owner.commit(ns, newcomer)
            await peer.release(answer.lease_id, grant=token)
            after, _ = await peer.lookup(tenant_b, b_blocks[:SLOTS // 2], lease_ms=60_000, grant=token)
            assert after.statuses == [LookupStatus.HIT] * (SLOTS // 2)  # released: its share is its own again


async def test_one_node_proving_with_many_peer_keys_still_pins_only_its_share(local_node, ns, grant):
    """Found in review: the share was counted per peer key, and the control plane issues a grant for any public key
    a node's key names, so one node key with k made-up peer keys pinned k shares (two: the whole node, and tenant
    A's reservations got -1). Now a peer's pins are counted per node (its grant's consumer), whatever key proves
    them. Control: another node gets a share of its own."""
    node = await local_node(node_id="src")
    tenant_b = Namespace("tenant-b", ns.model, ns.weight_version, ns.cache_config).validate()
    b_blocks = [os.urandom(32) for _ in range(SLOTS)]
    async with DataPlaneClient(node.address, key=node.core.config.node_key()) as owner:
        assert min(await owner.reserve(tenant_b, b_blocks)) >= 0
        assert await owner.commit(tenant_b, b_blocks) == SLOTS
        pinned = 0
        for half in (b_blocks[:SLOTS // 2], b_blocks[SLOTS // 2:]):  # one node key, two peer identities
            me = NodeIdentity()
            token = grant(me.public_key, "node-x", "src", tenant_b)
            async with DataPlaneClient(node.address, peer_proof=lambda g, m, me=me: me.proof(g, m, "src")) as peer:
                answer, _ = await peer.lookup(tenant_b, half, lease_ms=60_000, grant=token)
                pinned += answer.statuses.count(LookupStatus.HIT)
        assert pinned == SLOTS // 2, f"one node pinned {pinned} of {SLOTS} slots with two peer keys"
        slots = await owner.reserve(ns, [os.urandom(32) for _ in range(6)])
        assert min(slots) >= 0, f"tenant A was kept out of the node: {slots}"
        other = NodeIdentity()  # control: another node's peer has a share of its own (the first blocks are pinned,
        token = grant(other.public_key, "node-y", "src", tenant_b)  # not evicted, and still served)
        async with DataPlaneClient(node.address, peer_proof=lambda g, m: other.proof(g, m, "src")) as peer:
            answer, _ = await peer.lookup(tenant_b, b_blocks[:4], lease_ms=60_000, grant=token)
            assert answer.statuses == [LookupStatus.HIT] * 4
