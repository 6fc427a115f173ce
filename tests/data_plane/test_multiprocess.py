"""Real data-plane processes moving real bytes through NIXL (UCX on loopback), content verified."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import numpy as np
import pytest

from tenancy.peer_proof import NodeIdentity

from data_plane.client import DataPlaneClient, SharedTier
from data_plane.types import LookupStatus

pytestmark = pytest.mark.nixl


def make_hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


class Node:
    """A data-plane process with a client and its tier mapped in this (engine) process."""

    def __init__(self, proc, client: DataPlaneClient, tier: SharedTier, grant, peer_public_key: bytes) -> None:
        self.proc, self.client, self.tier, self._grant = proc, client, tier, grant
        self.node_id, self.address, self.peer_public_key = proc.node_id, proc.address, peer_public_key

    async def pull(self, ns, hashes, source: "Node", source_node_id: str | None = None, **kw):
        """Pulls from ``source`` with a grant for this node (as the control plane would issue)."""
        node_id = source.node_id if source_node_id is None else source_node_id
        grant = self._grant(self.peer_public_key, self.node_id, node_id, ns)
        return await self.client.pull(ns, hashes, node_id, source.address, grant=grant, **kw)

    async def store(self, ns, hashes: list[bytes], seed: int) -> dict[bytes, np.ndarray]:
        slots = await self.client.reserve(ns, hashes)
        assert -1 not in slots
        rng = np.random.default_rng(seed)
        data = {}
        for h, slot in zip(hashes, slots):
            data[h] = rng.integers(0, 256, size=self.tier.block_bytes, dtype=np.uint8)
            self.tier.slot(slot)[:] = data[h]
        assert await self.client.commit(ns, hashes) == len(hashes)
        return data

    async def holds(self, ns, expected: dict[bytes, np.ndarray]) -> bool:
        """Every block is committed here with exactly the expected bytes."""
        hashes = list(expected)
        slots, lease = await self.client.acquire(ns, hashes)
        try:
            return len(slots) == len(hashes) and all(
                np.array_equal(self.tier.slot(s), expected[h]) for s, h in zip(slots, hashes))
        finally:
            if lease:
                await self.client.release(lease)


@pytest.fixture
async def nodes(dp_process, grant):
    started: list[Node] = []

    async def start(node_id: str, **flags) -> Node:
        proc = await asyncio.to_thread(dp_process, node_id, **flags)
        client = DataPlaneClient(proc.address, key=proc.api_key)
        description = await client.describe_tier()
        node = Node(proc, client, SharedTier.open(description), grant, description.peer_public_key)
        started.append(node)
        return node

    yield start
    for node in started:
        node.tier.close()
        await node.client.close()


async def test_two_nodes_pull_verified_bytes(nodes, ns):
    a, b = await nodes("a"), await nodes("b")
    hashes = make_hashes(16)
    data = await a.store(ns, hashes, seed=1)
    result = await b.pull(ns, hashes + make_hashes(2), a)
    assert result.pulled == 16 and result.bytes_pulled == 16 * b.tier.block_bytes
    assert result.statuses == [LookupStatus.HIT] * 16 + [LookupStatus.MISS] * 2
    assert await b.holds(ns, data)
    again = await b.pull(ns, hashes, a)
    assert (again.pulled, again.already_local) == (0, 16)
    # the source's pins were released: all its blocks are evictable again
    for _ in range(4):
        assert -1 not in await a.client.reserve(ns, make_hashes(16))
        # (reserve without commit keeps slots; abort is not needed for this check)


async def test_three_nodes_pull_and_relay(nodes, ns):
    a, b, c = await nodes("a"), await nodes("b"), await nodes("c")
    from_a, from_b = make_hashes(8), make_hashes(8)
    data_a = await a.store(ns, from_a, seed=2)
    data_b = await b.store(ns, from_b, seed=3)
    ra, rb = await asyncio.gather(c.pull(ns, from_a, a),
                                  c.pull(ns, from_b, b))
    assert ra.pulled == rb.pulled == 8
    assert await c.holds(ns, {**data_a, **data_b})
    relay = await b.pull(ns, from_a, c)  # a block pulled by c serves b
    assert relay.pulled == 8 and await b.holds(ns, data_a)


async def test_pull_stops_at_the_first_miss(nodes, ns):
    a, b = await nodes("a"), await nodes("b")
    hashes = make_hashes(6)
    data = await a.store(ns, hashes[:2] + hashes[3:], seed=4)  # hashes[2] missing on the source
    result = await b.pull(ns, hashes, a)
    assert result.pulled == 2 and result.statuses[:3] == [LookupStatus.HIT, LookupStatus.HIT, LookupStatus.MISS]
    assert await b.holds(ns, {h: data[h] for h in hashes[:2]})


async def test_hit_pending_on_the_source_is_bounded_then_miss(nodes, ns):
    # the consumer's pending_wait_ms is what it asks for; the source caps it at its max_pending_wait_ms
    a, b = await nodes("a", max_pending_wait_ms=400), await nodes("b", pending_wait_ms=300)
    hashes = make_hashes(2)
    await a.client.reserve(ns, hashes)  # announced, never committed
    t0 = time.monotonic()
    result = await b.pull(ns, hashes, a)
    assert result.statuses == [LookupStatus.MISS] * 2 and 0.25 < time.monotonic() - t0 < 8  # < the 10 s pull bound


async def test_source_killed_mid_pull_yields_miss_without_corrupt_slots(nodes, ns):
    """SIGKILL the source while a stream of pulls runs (lookups and READs in flight): every pull returns
    in time, whatever it reports as HIT is committed with exactly the source's bytes, nothing else is."""
    flags = dict(block_bytes=1 << 20, capacity_bytes=256 << 20)
    a, b = await nodes("a", **flags), await nodes("b", **flags)
    hashes = make_hashes(256)
    data = await a.store(ns, hashes, seed=5)
    chunks = [hashes[i:i + 16] for i in range(0, 256, 16)]
    results = []

    async def pull_all():
        for chunk in chunks:
            results.append(await b.pull(ns, chunk, a, timeout_ms=5000))

    stream = asyncio.ensure_future(pull_all())
    while len(results) < 2:
        await asyncio.sleep(0.001)
    os.kill(a.proc.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    await asyncio.wait_for(stream, timeout=60)
    assert time.monotonic() - t0 < 45
    print("pulled per chunk:", [r.pulled for r in results])
    assert results[0].pulled == 16 and results[-1].pulled == 0
    for chunk, result in zip(chunks, results):
        hit = [h for h, s in zip(chunk, result.statuses) if s is LookupStatus.HIT]
        assert hit == chunk[:len(hit)]  # a prefix
        assert await b.holds(ns, {h: data[h] for h in hit})
        if len(hit) < len(chunk):
            assert (await b.client.acquire(ns, chunk[len(hit):]))[0] == []
    await b.client.ping()


async def test_restarted_source_is_handshaked_again(nodes, ns, dp_process):
    a, b = await nodes("a"), await nodes("b")
    first = make_hashes(2)
    await a.store(ns, first, seed=6)
    assert (await b.pull(ns, first, a)).pulled == 2
    a.proc.stop()
    a2 = await nodes("a", listen=a.address)  # same id and address, new NIXL agent
    second = make_hashes(2)
    data = await a2.store(ns, second, seed=7)
    result = await b.pull(ns, second, a2)
    if result.pulled == 0:  # the first attempt may only discover the stale agent
        result = await b.pull(ns, second, a2)
    assert result.pulled == 2 and await b.holds(ns, data)


async def test_block_size_mismatch_between_peers_is_refused(nodes, ns, block_bytes):
    a, b = await nodes("a"), await nodes("b", block_bytes=block_bytes * 2)
    await a.store(ns, make_hashes(1), seed=8)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await b.pull(ns, make_hashes(1), a)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "block_bytes" in err.value.details()


async def test_stale_route_to_another_node_is_a_miss(nodes, ns):
    a, b = await nodes("a"), await nodes("b")
    hashes = make_hashes(1)
    await a.store(ns, hashes, seed=9)
    result = await b.pull(ns, hashes, a, source_node_id="someone-else")
    assert result.statuses == [LookupStatus.MISS]


async def test_concurrent_pulls_of_one_prefix_move_its_bytes_once(nodes, ns):
    """16 simultaneous Pulls of the same prefix on one node share one transfer: the others wait for the
    blocks the first is bringing (joined) instead of fetching them again."""
    a, b = await nodes("a"), await nodes("b")
    prefix = make_hashes(32)
    data = await a.store(ns, prefix, seed=10)
    results = await asyncio.gather(*(b.pull(ns, prefix, a) for _ in range(16)))
    one_prefix = len(prefix) * b.tier.block_bytes
    assert all(r.statuses == [LookupStatus.HIT] * 32 and r.pulled + r.already_local == 32 for r in results)
    assert sum(r.bytes_pulled for r in results) == one_prefix
    assert sum(r.joined for r in results) + sum(r.already_local for r in results) == 15 * 32
    assert await b.holds(ns, data)
    # control: distinct prefixes pulled at the same time each move their own bytes
    others = [make_hashes(8) for _ in range(4)]
    for i, hashes in enumerate(others):
        await a.store(ns, hashes, seed=20 + i)
    distinct = await asyncio.gather(*(b.pull(ns, hashes, a) for hashes in others))
    assert sum(r.bytes_pulled for r in distinct) == 4 * 8 * b.tier.block_bytes
    assert sum(r.joined for r in distinct) == 0


async def test_a_block_arriving_by_pull_answers_a_peer_after_the_pull(nodes, ns, grant):
    """While b is pulling blocks from a (a frozen mid-pull), c's Lookup of them on b waits (HIT_PENDING)
    and answers HIT once they arrive, rather than MISS at once."""
    a, b = await nodes("a"), await nodes("b", max_pending_wait_ms=30_000)
    hashes, absent = make_hashes(4), make_hashes(1)
    data = await a.store(ns, hashes, seed=11)
    identity = NodeIdentity()  # this process plays peer c
    c_on_b = DataPlaneClient(b.address, peer_proof=lambda g, method: identity.proof(g, method, "b"))
    token = grant(identity.public_key, "c", "b", ns)
    try:
        # control: a block nobody is bringing is a MISS without waiting
        t0 = time.monotonic()
        answer, _ = await c_on_b.lookup(ns, absent, pending_wait_ms=20_000, grant=token)
        assert answer.statuses == [LookupStatus.MISS] and time.monotonic() - t0 < 5
        os.kill(a.proc.proc.pid, signal.SIGSTOP)
        try:
            pull = asyncio.ensure_future(b.pull(ns, hashes, a, timeout_ms=30_000))
            await asyncio.sleep(0.5)  # b has claimed the blocks and waits on frozen a
            lookup = asyncio.ensure_future(c_on_b.lookup(ns, hashes, pending_wait_ms=25_000, grant=token))
            await asyncio.sleep(1.0)
            assert not lookup.done() and not pull.done()
        finally:
            os.kill(a.proc.proc.pid, signal.SIGCONT)
        result = await asyncio.wait_for(pull, 40)
        answer, _ = await asyncio.wait_for(lookup, 40)
        assert result.pulled == 4 and answer.statuses == [LookupStatus.HIT] * 4
        await c_on_b.release(answer.lease_id, grant=token)
        assert await b.holds(ns, data)
    finally:
        await c_on_b.close()


async def test_a_corrupted_source_block_is_discarded_never_served(nodes, ns, monkeypatch):
    """A source block whose bytes changed after its checksum was taken fails verification on the puller:
    it and its successors are MISS and never committed; the block before it arrives intact. Control: a
    node that does not verify takes the corrupted bytes."""
    a, b = await nodes("a"), await nodes("b")
    monkeypatch.setenv("KVMESH_DP_VERIFY_PULLS", "false")
    unchecked = await nodes("u")
    hashes = make_hashes(3)
    data = await a.store(ns, hashes, seed=12)
    slots, lease = await a.client.acquire(ns, hashes[1:2])
    a.tier.slot(slots[0])[100] ^= 0xFF  # corrupted after commit (its CRC was taken at commit)
    await a.client.release(lease)
    result = await b.pull(ns, hashes, a)
    assert result.statuses == [LookupStatus.HIT, LookupStatus.MISS, LookupStatus.MISS] and result.pulled == 1
    assert await b.holds(ns, {hashes[0]: data[hashes[0]]})
    assert (await b.client.acquire(ns, hashes[1:]))[0] == []
    taken = await unchecked.pull(ns, hashes, a)
    assert taken.pulled == 3 and not await unchecked.holds(ns, {hashes[1]: data[hashes[1]]})
