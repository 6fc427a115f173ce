"""WorkerSide against a real data plane: slot -> paged-cache copies of waiting requests, their completion
report, failed copies, the misplace_one_block negative-control hook, and a cache whose blocks do not fit the slots."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from kvmesh.hashing import BlockHasher
from kvmesh.namespace import CacheConfig, Namespace
from kvmesh_apps.fleet import Fleet

from data_plane.client import DataPlaneClient, SharedTier
from engine_connector.block_shape import EngineBlocks, SlotSizeMismatch
from engine_connector.config import KV_LAYOUT
from engine_connector.metadata import BlockLoad, KvmeshConnectorMetadata, SaveRun
from engine_connector.node_link import NodeLink
from engine_connector.worker_side import WorkerSide

# One layer of [num_blocks, kv_heads, block_size, 2 * head_size] float32 = 1 KiB per block (the fleet's slots).
SHAPE = (16, 1, 4, 64)


def _ns(fleet: Fleet) -> Namespace:
    return Namespace(fleet.tenant, "tiny", "rev1", CacheConfig(block_size=32, kv_dtype="float32",
                                                               kv_layout=KV_LAYOUT)).validate()


def _pinned_slots(fleet: Fleet, n: int, base: int) -> tuple[list[int], str]:
    """Store ``n`` blocks on dp2 (block i filled with byte ``base + i``) and pin them: (slots, lease)."""
    hashes = BlockHasher().block_hashes(list(range(base * 1000, base * 1000 + 32 * n)), 32)

    async def run() -> tuple[list[int], str]:
        async with DataPlaneClient(fleet.data_planes["dp2"].address, key=fleet.node_keys["dp2"],
                                   tls=fleet.client_tls("engine-dp2")) as client:
            tier = SharedTier.open(await client.describe_tier())
            for i, slot in enumerate(await client.reserve(_ns(fleet), hashes)):
                tier.slot(slot)[:] = np.uint8(base + i)
            tier.close()
            await client.commit(_ns(fleet), hashes)
            return await client.acquire(_ns(fleet), hashes, lease_ms=30_000)

    return asyncio.run(run())


@pytest.fixture
def worker(small_fleet: Fleet):
    made = []

    def make(shape: tuple[int, ...] = SHAPE, **kwargs) -> tuple[WorkerSide, torch.Tensor]:
        link = NodeLink(small_fleet.data_planes["dp2"].address, small_fleet.node_keys["dp2"],
                        tls=small_fleet.client_tls("engine-dp2"))
        side = WorkerSide(link, _ns(small_fleet), EngineBlocks(shape[2], "/models/tiny", "float32"), **kwargs)
        made.append((side, link))
        cache = torch.zeros(shape)
        side.register_kv_caches({"layer0": cache})
        return side, cache

    yield make
    for side, link in made:
        side.close()
        link.close()


def _block_byte(cache: torch.Tensor, block: int) -> int:
    values = set(cache[block].view(torch.uint8).flatten().tolist())
    assert len(values) == 1
    return values.pop()


def test_loads_land_in_their_blocks_and_the_request_is_reported_finished(small_fleet: Fleet, worker) -> None:
    side, cache = worker()
    slots, lease = _pinned_slots(small_fleet, 3, base=10)
    side.load(KvmeshConnectorMetadata(loads=[BlockLoad("r1", 5 + i, slot) for i, slot in enumerate(slots)],
                                      leases=[lease]))
    assert side.take_finished_loads() == {"r1"} and side.take_finished_loads() == set()
    assert [_block_byte(cache, b) for b in (5, 6, 7)] == [10, 11, 12]
    assert side.take_failed_block_ids() == set()


def test_a_failed_copy_is_reported_with_the_finished_request(small_fleet: Fleet, worker) -> None:
    side, _ = worker()
    slots, lease = _pinned_slots(small_fleet, 1, base=20)
    side.load(KvmeshConnectorMetadata(loads=[BlockLoad("r2", 3, slots[0]), BlockLoad("r2", SHAPE[0], slots[0])],
                                      leases=[lease]))
    assert side.take_failed_block_ids() == {SHAPE[0]} and side.take_finished_loads() == {"r2"}


def test_misplace_one_block_writes_the_middle_block_from_the_wrong_slot(small_fleet: Fleet, worker) -> None:
    good, good_cache = worker()
    bad, bad_cache = worker(misplace_one_block=True)
    slots, lease = _pinned_slots(small_fleet, 4, base=30)
    loads = [BlockLoad("r3", i, slot) for i, slot in enumerate(slots)]
    good.load(KvmeshConnectorMetadata(loads=loads))
    bad.load(KvmeshConnectorMetadata(loads=loads, leases=[lease]))
    assert [_block_byte(good_cache, b) for b in range(4)] == [30, 31, 32, 33]  # positive control
    assert [_block_byte(bad_cache, b) for b in range(4)] == [30, 31, 31, 33]


def test_a_restarted_data_plane_is_mapped_again_and_never_read_through_the_old_mapping(small_fleet: Fleet,
                                                                                       worker) -> None:
    """The data plane restarts under a running engine (a crash, then a supervisor): its tier is a new file. Loads
    of the step that notices fail (recompute: their slots may be either tier's); the new tier is mapped, so the
    next loads read the bytes the new data plane holds and saves land where it checksums them."""
    side, cache = worker()
    slots, lease = _pinned_slots(small_fleet, 2, base=40)
    side.load(KvmeshConnectorMetadata(loads=[BlockLoad("r5", i, slot) for i, slot in enumerate(slots)],
                                      leases=[lease]))
    assert [_block_byte(cache, b) for b in (0, 1)] == [40, 41]  # positive control, before the restart
    small_fleet.restart_data_plane("dp2")
    slots, lease = _pinned_slots(small_fleet, 2, base=50)  # on the new data plane, perhaps the same slot numbers
    side.load(KvmeshConnectorMetadata(loads=[BlockLoad("r6", 2 + i, slot) for i, slot in enumerate(slots)],
                                      leases=[lease]))
    assert side.take_failed_block_ids() == {2, 3} and side.take_finished_loads() >= {"r6"}
    slots, lease = _pinned_slots(small_fleet, 2, base=60)
    side.load(KvmeshConnectorMetadata(loads=[BlockLoad("r7", 4 + i, slot) for i, slot in enumerate(slots)],
                                      leases=[lease]))
    assert side.take_failed_block_ids() == set() and [_block_byte(cache, b) for b in (4, 5)] == [60, 61]
    cache[6] = 0
    cache[6].view(torch.uint8).fill_(77)
    hashes = BlockHasher().block_hashes(list(range(7000, 7032)), 32)
    side.save(KvmeshConnectorMetadata(saves=[SaveRun("r8", 0, [6], hashes)]))

    async def saved() -> bytes:
        async with DataPlaneClient(small_fleet.data_planes["dp2"].address, key=small_fleet.node_keys["dp2"],
                                   tls=small_fleet.client_tls("engine-dp2")) as client:
            slots, _ = await client.acquire(_ns(small_fleet), hashes, lease_ms=30_000)
            tier = SharedTier.open(await client.describe_tier())
            data = bytes(tier.slot(slots[0]))
            tier.close()
            return data

    assert set(asyncio.run(saved())) == {77}, "the save landed in the new tier, where Commit checksummed it"


def test_a_cache_whose_blocks_are_not_the_slot_size_is_refused_with_the_remedy(small_fleet: Fleet, worker) -> None:
    with pytest.raises(SlotSizeMismatch) as refused:
        worker((16, 1, 8, 64))  # 2 KiB blocks of 8 tokens against 1 KiB slots
    message = str(refused.value)
    address = small_fleet.data_planes["dp2"].address
    assert f"the data plane at {address} has 1024-byte slots but this engine's KV blocks are 2048 bytes" in message
    assert "`kvmesh up --block-bytes 2048 --block-tokens 8`" in message
    assert "`kvmesh up --model /models/tiny --dtype float32 --block-tokens 8`" in message
    assert "\n" not in message
    worker()  # positive control: the slot-sized cache of the same fleet is adopted


def test_a_frozen_data_plane_costs_a_step_one_rpc_bound_and_saves_pause(small_fleet: Fleet) -> None:
    """Found in review: saves run inside the step (the forward waits for them), one Reserve per request, each
    bounded by rpc_timeout_s: with the node's data plane frozen, a step whose N requests filled a block waited N
    bounds, and every step after it the same. Now the step's other saves are skipped after the first failure, and
    saves pause (1 s, doubling while they fail). Control: once the data plane answers and the pause ends, saves
    land again."""
    import signal
    import time

    clock = [1000.0]
    link = NodeLink(small_fleet.data_planes["dp2"].address, small_fleet.node_keys["dp2"], rpc_timeout_s=1.0,
                    tls=small_fleet.client_tls("engine-dp2"))
    side = WorkerSide(link, _ns(small_fleet), EngineBlocks(SHAPE[2], "/models/tiny", "float32"),
                      clock=lambda: clock[0])
    cache = torch.zeros(SHAPE)
    side.register_kv_caches({"layer0": cache})

    def step(first_token: int) -> tuple[KvmeshConnectorMetadata, float]:
        runs = [SaveRun(f"r{first_token + i}", 0, [i],
                        BlockHasher().block_hashes(list(range(first_token + 32 * i, first_token + 32 * (i + 1))), 32))
                for i in range(4)]
        started = time.monotonic()
        side.save(KvmeshConnectorMetadata(saves=runs))
        return runs, time.monotonic() - started

    proc = small_fleet.data_planes["dp2"].proc
    proc.send_signal(signal.SIGSTOP)
    try:
        _, took = step(100_000)
        assert took < 3.0, f"a step of 4 saves waited {took:.1f} s on a frozen data plane (one bound: ~2 s)"
        _, took = step(200_000)
        assert took < 0.2, "the next step waited on the frozen data plane again"
    finally:
        proc.send_signal(signal.SIGCONT)
    clock[0] += 10.0  # the pause is over
    runs, _ = step(300_000)

    async def stored() -> list[int]:
        async with DataPlaneClient(small_fleet.data_planes["dp2"].address, key=small_fleet.node_keys["dp2"],
                                   tls=small_fleet.client_tls("engine-dp2")) as client:
            slots, _ = await client.acquire(_ns(small_fleet), [h for run in runs for h in run.block_hashes],
                                            lease_ms=1_000)
            return slots

    try:
        assert len(asyncio.run(stored())) == 4, "saves did not resume once the data plane answered"
    finally:
        side.close()
        link.close()


def test_a_refused_reserve_does_not_pause_saves_a_silent_one_does() -> None:
    """Found in review: saves paused after any failed Reserve, so a tenant at its per-node limit (an instant
    RESOURCE_EXHAUSTED, an answer) had its saves paused up to 60 s after room freed. Only a data plane that does not
    answer (DEADLINE_EXCEEDED, UNAVAILABLE, a timeout) pauses them. (A stand-in link: the frozen case runs for
    real above.)"""
    class Link:
        def __init__(self, code):
            self.code = code

        def reserve(self, *args, **kwargs):
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "refused")

    run = SaveRun("r", 0, [0], [b"\x01" * 32])
    for code, pauses in ((grpc.StatusCode.RESOURCE_EXHAUSTED, False), (grpc.StatusCode.PERMISSION_DENIED, False),
                         (grpc.StatusCode.DEADLINE_EXCEEDED, True), (grpc.StatusCode.UNAVAILABLE, True)):
        side = WorkerSide(Link(code), Namespace("t", "m", "v", CacheConfig(block_size=32)),
                          EngineBlocks(4, "/models/tiny", "float32"))
        assert (side._reserve(run) is None) is pauses, code
