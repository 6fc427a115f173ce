"""EventPublisher against a real control plane: ordered delivery, outages, resync."""

from __future__ import annotations

import asyncio
import hashlib
import logging

from kvmesh.namespace import CacheConfig, Namespace

from control_plane.model import ALL_TIERS, Medium, NodeInfo
from control_plane.publisher import EventPublisher
from control_plane.server import serve
from tenancy.auth import auth_metadata
from tenancy.model import Principal, Role, TenantPolicy

NS = Namespace("acme", "tiny-llama", "v1", CacheConfig(block_size=32))


def hashes(n, tag=""):
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


class Node:
    """What the node holds: the publisher's snapshot source."""

    def __init__(self):
        self.held: list[bytes] = []

    def snapshot(self):
        return [(NS, int(Medium.CPU), list(self.held))]


ADMIN = Principal("bootstrap", Role.ADMIN)


async def longest(control_plane, hs):
    return (await control_plane.core.lookup_prefix(ADMIN, NS, hs, [], None, ALL_TIERS)).longest


def publisher(port, node, admin_key, **kw):
    return EventPublisher(f"127.0.0.1:{port}", NodeInfo("node-1", "127.0.0.1:7001"), node.snapshot,
                          metadata=auth_metadata(admin_key), **kw)


async def test_changes_arrive_in_order(control_plane, admin_key):
    node, hs = Node(), hashes(10)
    pub = publisher(control_plane.port, node, admin_key)
    await pub.start()
    try:
        for h in hs:
            pub.stored(NS, [h], int(Medium.CPU))
        pub.removed(NS, hs[7:8], int(Medium.CPU))
        assert await pub.flush(5)
        assert await longest(control_plane, hs) == 7
    finally:
        await pub.stop()


async def test_outage_then_recovery_delivers_everything(cp_config, admin_key, caplog):
    """... and the outage is a few log lines, not one per retry (10 retries a second here)."""
    running = await serve(cp_config)
    await running.core.tenants.create_tenant("acme", "", TenantPolicy())
    port = running.port
    node, hs = Node(), hashes(6)
    pub = publisher(port, node, admin_key, retry_s=0.1)
    await pub.start()
    try:
        pub.stored(NS, hs[:3], int(Medium.CPU))
        assert await pub.flush(5)
        await running.stop()
        pub.stored(NS, hs[3:], int(Medium.CPU))  # enqueued while the control plane is down
        caplog.set_level(logging.WARNING, logger="control_plane.publisher")
        assert not await pub.flush(2.0)
        running = await serve(cp_config.model_copy(update={"listen": f"127.0.0.1:{port}"}))
        assert await pub.flush(10)
        said = [r.getMessage() for r in caplog.records if r.name == "control_plane.publisher"]
        assert len(said) == 2 and "unreachable" in said[0] and "reachable again" in said[1], said
        assert await longest(running, hs) == 6
    finally:
        await pub.stop()
        await running.stop()


async def test_fenced_node_reregisters_and_resyncs_its_snapshot(control_plane, admin_key):
    node, hs = Node(), hashes(4)
    pub = publisher(control_plane.port, node, admin_key)
    await pub.start()
    try:
        node.held = hs[:2]
        pub.stored(NS, hs[:2], int(Medium.CPU))
        assert await pub.flush(5)
        first = pub.incarnation
        # Someone else registers the same node id: the publisher's incarnation is now stale.
        await control_plane.core.register_node(ADMIN, NodeInfo("node-1", "127.0.0.1:7001"))
        assert await longest(control_plane, hs) == 0
        node.held = hs[:3]
        pub.stored(NS, hs[2:3], int(Medium.CPU))
        assert await pub.flush(10)
        assert pub.incarnation > first + 1
        assert await longest(control_plane, hs) == 3
    finally:
        await pub.stop()


async def test_stop_ends_the_publisher_while_a_resync_is_pending(control_plane, admin_key):
    """stop() cancels the stream while the node must register again (the control plane asked for a resync and
    the stream's feeder has not cancelled the call yet): the cancellation ends the publisher; it was taken for
    the feeder's: the stopping publisher registered the node again and streamed on (a data plane's stop hung
    once in a test teardown under load)."""
    node = Node()
    pub = publisher(control_plane.port, node, admin_key)
    await pub.start()
    pub.stored(NS, hashes(2), int(Medium.CPU))
    assert await pub.flush(5)  # streaming
    incarnation = pub.incarnation
    pub._need_register = True  # what a resync code from a heartbeat sets (its wake-up not delivered yet)
    await asyncio.wait_for(pub.stop(), 5)
    assert pub.incarnation == incarnation, "the stopped publisher registered the node again"


async def test_a_burst_of_clears_is_delivered_in_batches_the_control_plane_takes(control_plane, admin_key):
    """A control plane takes at most MAX_CLEARS_PER_BATCH clears a batch (each sweeps the node's namespaces): a
    publisher with more queued splits them, so all are delivered, and the blocks stored after them too."""
    from control_plane.model import MAX_CLEARS_PER_BATCH
    node, hs = Node(), hashes(3, "after-clears")
    pub = publisher(control_plane.port, node, admin_key)
    await pub.start()
    try:
        for _ in range(3 * MAX_CLEARS_PER_BATCH + 1):
            pub.cleared(NS, int(Medium.CPU))
        pub.stored(NS, hs, int(Medium.CPU))
        assert await pub.flush(30)
        assert await longest(control_plane, hs) == 3
    finally:
        await pub.stop()
