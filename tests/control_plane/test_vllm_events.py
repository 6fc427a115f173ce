"""A stock vLLM event publisher (vLLM's own ZmqEventPublisher and event types) populates the block map."""

from __future__ import annotations

import asyncio

import pytest

vllm_events = pytest.importorskip("vllm.distributed.kv_events", reason="needs vLLM")

from kvmesh.hashing import BlockHasher  # noqa: E402
from kvmesh.namespace import CacheConfig, Namespace  # noqa: E402

from control_plane.model import ALL_TIERS, Medium, NodeInfo  # noqa: E402
from control_plane.publisher import EventPublisher  # noqa: E402
from control_plane.vllm_events import VllmEventAdapter  # noqa: E402
from tenancy.auth import auth_metadata  # noqa: E402

NS = Namespace("acme", "tiny-llama", "v1", CacheConfig(block_size=32))
TOKENS = list(range(5000, 5000 + 32 * 8))


def stored(hashes, medium="GPU", block_size=32):
    return vllm_events.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=TOKENS[:len(hashes) * 32],
                                   block_size=block_size, lora_id=None, medium=medium, lora_name=None)


async def wait_for(cond, timeout=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_vllm_events_reach_the_block_map(control_plane, tmp_path, admin, admin_key):
    hashes = BlockHasher().block_hashes(TOKENS, 32)
    endpoint = f"ipc://{tmp_path}/kv-events"
    vllm_pub = vllm_events.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint)
    publisher = EventPublisher(f"127.0.0.1:{control_plane.port}", NodeInfo("engine-1", "127.0.0.1:7001"),
                               snapshot=lambda: [], metadata=auth_metadata(admin_key))
    await publisher.start()
    adapter = VllmEventAdapter(publisher, NS)
    task = asyncio.create_task(adapter.run(endpoint))

    async def longest(tiers=ALL_TIERS):
        await publisher.flush(5)
        return (await control_plane.core.lookup_prefix(admin, NS, hashes, [], None, tiers)).longest

    try:
        async def connected():  # PUB/SUB drops messages until the subscription is set up
            vllm_pub.publish(vllm_events.KVEventBatch(ts=0.0, events=[stored(hashes[:1])]))
            await asyncio.sleep(0.05)
            return adapter.stats.stored > 0

        await wait_for(connected)
        vllm_pub.publish(vllm_events.KVEventBatch(ts=0.0, events=[stored(hashes), stored(hashes[:2], "CPU")]))
        await wait_for(lambda: _eq(longest(), 8))
        assert (await control_plane.core.lookup_prefix(admin, NS, hashes, [], None, Medium.CPU.bit)).longest == 2
        vllm_pub.publish(vllm_events.KVEventBatch(ts=0.0, events=[
            vllm_events.BlockRemoved(block_hashes=hashes[5:6], medium="GPU"),
            stored(hashes[:1], block_size=16),  # wrong block size: refused, not applied
        ]))
        await wait_for(lambda: _eq(longest(), 5))
        assert adapter.stats.refused == 1
        vllm_pub.publish(vllm_events.KVEventBatch(ts=0.0, events=[vllm_events.AllBlocksCleared()]))
        await wait_for(lambda: _eq(longest(), 0))
    finally:
        task.cancel()
        vllm_pub.shutdown()
        await publisher.stop()


async def _eq(coro, value):
    return await coro == value


def test_sequence_gap_and_garbage_are_handled():
    class Recorder:
        def __init__(self):
            self.calls = []

        def stored(self, ns, hashes, medium):
            self.calls.append(("stored", len(hashes)))

        def removed(self, ns, hashes, medium):
            self.calls.append(("removed", len(hashes)))

        def cleared(self, ns, medium=0):
            self.calls.append(("cleared",))

    import msgspec

    rec = Recorder()
    adapter = VllmEventAdapter(rec, NS)
    hashes = BlockHasher().block_hashes(TOKENS, 32)
    payload = msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=0.0, events=[stored(hashes[:2])]))
    adapter.handle([b"", (0).to_bytes(8, "big"), payload])
    adapter.handle([b"", (3).to_bytes(8, "big"), payload])  # seqs 1 and 2 were lost
    adapter.handle([b"", (4).to_bytes(8, "big"), b"\xc1 not msgpack"])
    adapter.handle([b"only one frame"])
    int_hashes = msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=0.0, events=[stored([123, 456])]))
    adapter.handle([b"", (5).to_bytes(8, "big"), int_hashes])
    assert rec.calls == [("stored", 2), ("cleared",), ("stored", 2)]
    assert (adapter.stats.gaps, adapter.stats.refused) == (1, 3)
