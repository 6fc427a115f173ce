"""The local engine API and the peer Lookup of one in-process node, over real gRPC."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import numpy as np
import pytest

from kvmesh.channels import channel
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh.v1 import common_pb2, data_plane_pb2, data_plane_pb2_grpc

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.types import BlockKey, LookupStatus, Medium

BLOCK_BYTES = 64 * 1024  # the conftest nodes' slot size (checked below)


def make_hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def make_block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=BLOCK_BYTES, dtype=np.uint8)


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, list[bytes], int]] = []

    def stored(self, ns, block_hashes, medium):
        self.events.append(("stored", ns.fingerprint, list(block_hashes), int(medium)))

    def removed(self, ns, block_hashes, medium):
        self.events.append(("removed", ns.fingerprint, list(block_hashes), int(medium)))


@pytest.fixture
async def node(local_node):
    running = await local_node()
    client = DataPlaneClient(running.address, key=running.core.config.node_key())
    tier = SharedTier.open(await client.describe_tier())
    yield running, client, tier
    tier.close()
    await client.close()


async def store(client, tier, ns, hashes, seed=0):
    slots = await client.reserve(ns, hashes)
    assert -1 not in slots
    blocks = [make_block(seed + i) for i in range(len(hashes))]
    for slot, data in zip(slots, blocks):
        tier.slot(slot)[:] = data
    assert await client.commit(ns, hashes) == len(hashes)
    return blocks


async def test_write_commit_acquire_roundtrip(node, ns, block_bytes):
    running, client, tier = node
    desc = await client.describe_tier()
    assert (desc.block_bytes, desc.num_slots) == (block_bytes, 16) == (BLOCK_BYTES, 16)
    hashes = make_hashes(3)
    blocks = await store(client, tier, ns, hashes)
    assert await client.commit(ns, hashes) == 0  # idempotent
    slots, lease = await client.acquire(ns, hashes + make_hashes(1))
    assert len(slots) == 3 and lease
    assert all(np.array_equal(tier.slot(s), b) for s, b in zip(slots, blocks))
    await client.release(lease)
    await client.release(lease)  # idempotent


async def test_a_committed_block_changed_in_memory_is_never_handed_out(node, ns):
    """Bytes of a committed block changed in the tier (a modified UCX, a process of the same uid): Acquire checks
    each block's CRC-32C, so the changed block and its successors are a MISS, now and after; its predecessor is
    served (positive control)."""
    _, client, tier = node
    hashes = make_hashes(3)
    blocks = await store(client, tier, ns, hashes)
    slots, lease = await client.acquire(ns, hashes)
    assert len(slots) == 3, "control: all three are served while intact"
    await client.release(lease)
    tier.slot(slots[1])[77] ^= 0x01
    for _ in range(2):
        slots, lease = await client.acquire(ns, hashes)
        assert len(slots) == 1 and np.array_equal(tier.slot(slots[0]), blocks[0])
        await client.release(lease)


async def test_uncommitted_blocks_are_invisible(node, ns):
    _, client, _ = node
    hashes = make_hashes(2)
    await client.reserve(ns, hashes)
    assert (await client.acquire(ns, hashes))[0] == []
    answer, _ = await client.lookup(ns, hashes, pending_wait_ms=1)
    assert answer.statuses == [LookupStatus.MISS] * 2 and answer.lease_id == ""
    await client.abort(ns, hashes)
    assert await client.reserve(ns, hashes) != [-1, -1]  # slots were freed


async def test_hit_pending_waits_at_most_the_bound_then_misses(node, ns):
    _, client, _ = node
    hashes = make_hashes(1)
    await client.reserve(ns, hashes)
    t0 = time.monotonic()
    answer, _ = await client.lookup(ns, hashes, pending_wait_ms=300)
    waited = time.monotonic() - t0
    assert answer.statuses == [LookupStatus.MISS]
    assert 0.25 <= waited < 1.5


async def test_a_committed_block_a_pull_is_still_settling_is_pending(node, ns):
    """A Lookup whose blocks are all committed (the answer built in native loops) still waits for one a pull on
    this node has claimed (Pulls.arriving) until the pull settles it, as one block at a time did."""
    running, client, tier = node
    hashes = make_hashes(2)
    await store(client, tier, ns, hashes)
    answer, _ = await client.lookup(ns, hashes, pending_wait_ms=1)  # positive control: nothing claimed
    assert answer.statuses == [LookupStatus.HIT] * 2
    await client.release(answer.lease_id)
    claim = asyncio.get_running_loop().create_future()
    running.core.pulls.arriving[BlockKey(ns.fingerprint, hashes[1])] = claim
    try:
        t0 = time.monotonic()
        answer, _ = await client.lookup(ns, hashes, pending_wait_ms=300)
        assert time.monotonic() - t0 >= 0.25, "the claimed block was answered without waiting for its pull"
    finally:
        del running.core.pulls.arriving[BlockKey(ns.fingerprint, hashes[1])]
        claim.set_result(None)
    await client.release(answer.lease_id)


async def test_hit_pending_becomes_hit_when_committed_in_time(node, ns):
    _, client, tier = node
    hashes = make_hashes(2)
    slots = await client.reserve(ns, hashes)
    lookup = asyncio.ensure_future(client.lookup(ns, hashes, pending_wait_ms=2000))
    await asyncio.sleep(0.1)
    tier.slot(slots[0])[:] = 7
    await client.commit(ns, hashes)
    answer, block_bytes = await lookup
    assert answer.statuses == [LookupStatus.HIT] * 2 and block_bytes == BLOCK_BYTES and answer.lease_id


async def test_pending_wait_is_capped_by_the_server(local_node, ns):
    running = await local_node(max_pending_wait_ms=100, pending_wait_ms=50)
    async with DataPlaneClient(running.address, key=running.core.config.node_key()) as client:
        hashes = make_hashes(1)
        await client.reserve(ns, hashes)
        t0 = time.monotonic()
        answer, _ = await client.lookup(ns, hashes, pending_wait_ms=60_000)
        # Capped at 100 ms: an uncapped wait would take 60 s (the bound is generous for a loaded machine).
        assert answer.statuses == [LookupStatus.MISS] and time.monotonic() - t0 < 10


async def test_lookup_pins_under_a_lease_that_expires(local_node, ns):
    running = await local_node(capacity_bytes=2 * BLOCK_BYTES)
    async with DataPlaneClient(running.address, key=running.core.config.node_key()) as client:
        hashes = make_hashes(2)
        await client.reserve(ns, hashes)
        await client.commit(ns, hashes)
        answer, _ = await client.lookup(ns, hashes, lease_ms=3000)
        assert answer.statuses == [LookupStatus.HIT] * 2
        assert await client.reserve(ns, make_hashes(1)) == [-1]  # both pinned: nothing evictable
        for _ in range(200):  # the lease expires and the sweeper unpins (ordering, not speed)
            if await client.reserve(ns, make_hashes(1)) != [-1]:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the expired lease never unpinned its blocks")


async def test_selective_offload_caps_tokens_per_request(node, ns):
    _, client, _ = node
    slots = await client.reserve(ns, make_hashes(4), max_offload_tokens=64)  # 2 blocks of 32 tokens
    assert slots[2:] == [-1, -1] and -1 not in slots[:2]
    slots = await client.reserve(ns, make_hashes(2), max_offload_tokens=64, first_block_index=1)
    assert slots[1] == -1 and slots[0] != -1


async def test_disk_tier_demotes_and_promotes(local_node, ns, tmp_path):
    running = await local_node(capacity_bytes=2 * BLOCK_BYTES, disk_dir=tmp_path, disk_capacity_bytes=8 * BLOCK_BYTES)
    sink = RecordingSink()
    running.core.events = sink
    async with DataPlaneClient(running.address, key=running.core.config.node_key()) as client:
        tier = SharedTier.open(await client.describe_tier())
        first, rest = make_hashes(2), make_hashes(2)
        blocks = await store(client, tier, ns, first, seed=10)
        await store(client, tier, ns, rest, seed=20)  # evicts `first` to disk
        assert ("removed", ns.fingerprint, first[:1], Medium.CPU) in sink.events
        assert ("stored", ns.fingerprint, first[:1], Medium.DISK) in sink.events
        assert (await client.acquire(ns, first, media=[Medium.CPU]))[0] == []  # tier filter: CPU only
        slots, lease = await client.acquire(ns, first, media=[Medium.CPU, Medium.DISK])
        assert len(slots) == 2
        assert all(np.array_equal(tier.slot(s), b) for s, b in zip(slots, blocks))
        assert ("stored", ns.fingerprint, first[:1], Medium.CPU) in sink.events
        await client.release(lease)
        snapshot = {(fp.fingerprint, medium): set(h) for fp, medium, h in running.core.snapshot()}
        assert snapshot[(ns.fingerprint, Medium.CPU)] == set(first)
        assert snapshot[(ns.fingerprint, Medium.DISK)] >= set(first)
        tier.close()


async def test_corrupt_disk_block_is_a_miss(local_node, ns, tmp_path):
    running = await local_node(capacity_bytes=BLOCK_BYTES, disk_dir=tmp_path, disk_capacity_bytes=4 * BLOCK_BYTES)
    async with DataPlaneClient(running.address, key=running.core.config.node_key()) as client:
        tier = SharedTier.open(await client.describe_tier())
        h = make_hashes(2)
        await store(client, tier, ns, h[:1])
        await store(client, tier, ns, h[1:])  # h[0] -> disk
        disk_file = next(tmp_path.glob("*.disk"))
        with open(disk_file, "r+b") as f:
            f.write(b"\xff" * 64)  # slot 0 holds h[0]
        assert (await client.acquire(ns, h[:1], media=[Medium.DISK]))[0] == []
        tier.close()


@pytest.mark.parametrize("mutate, code, message", [
    (lambda ns, h: (ns, h * 2), grpc.StatusCode.INVALID_ARGUMENT, "duplicates"),
    (lambda ns, h: (ns, [b"short"]), grpc.StatusCode.INVALID_ARGUMENT, "has 5 bytes"),
    (lambda ns, h: (ns, make_hashes(65)), grpc.StatusCode.INVALID_ARGUMENT, "65 block hashes in one request; the limit is 64"),
    (lambda ns, h: (Namespace("Bad Tenant", "m", "r", ns.cache_config), h), grpc.StatusCode.INVALID_ARGUMENT,
     "not a valid tenant"),
    (lambda ns, h: (Namespace(ns.tenant, ns.model, ns.weight_version, CacheConfig(block_size=16)), h),
     grpc.StatusCode.INVALID_ARGUMENT, "block_size is 16 tokens; this node stores 32-token blocks"),
])
async def test_bad_inputs_are_clear_errors(local_node, ns, mutate, code, message):
    running = await local_node(max_hashes_per_request=64, block_tokens=32)
    bad_ns, bad_hashes = mutate(ns, make_hashes(1))
    async with DataPlaneClient(running.address, key=running.core.config.node_key()) as client:
        for call in (lambda: client.reserve(bad_ns, bad_hashes), lambda: client.lookup(bad_ns, bad_hashes),
                     lambda: client.acquire(bad_ns, bad_hashes)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call()
            assert err.value.code() == code and message in err.value.details()


async def test_commit_errors_name_the_problem(node, ns):
    _, client, _ = node
    other = Namespace("tenant-b", "tiny-llama", "rev1", ns.cache_config)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.commit(other, make_hashes(1))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "unknown namespace" in err.value.details()
    await client.reserve(ns, make_hashes(1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.commit(ns, make_hashes(1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "reserve it first" in err.value.details()


async def test_lookup_of_an_unknown_namespace_is_a_miss_and_gpu_is_not_a_tier(node, ns):
    running, client, _ = node
    answer, _ = await client.lookup(ns, make_hashes(2))
    assert answer.statuses == [LookupStatus.MISS] * 2
    async with channel(client.address, running.core.config.node_key()) as channel_:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await data_plane_pb2_grpc.DataPlaneStub(channel_).Lookup(data_plane_pb2.LookupRequest(
                namespace=ns.to_proto(), block_hashes=make_hashes(1), media=[common_pb2.MEDIUM_GPU]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "MEDIUM_GPU" in err.value.details()


async def test_handshake_refuses_another_block_size(node):
    _, client, _ = node
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.exchange_agent_metadata("peer", b"", BLOCK_BYTES * 2)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "block_bytes mismatch" in err.value.details()


async def test_pull_from_itself_or_nowhere(node, ns):
    running, client, _ = node
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.pull(ns, make_hashes(1), running.core.node_id, running.address)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    t0 = time.monotonic()
    result = await client.pull(ns, make_hashes(2), "gone", "127.0.0.1:1", timeout_ms=2000)
    assert result.statuses == [LookupStatus.MISS] * 2 and result.pulled == 0
    assert time.monotonic() - t0 < 7  # within the call's own deadline (timeout_ms + 5 s): a refused source is a MISS
