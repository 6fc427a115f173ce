"""SchedulerSide against a real fleet (control plane, two data planes) and stand-ins for vLLM's
Request and KV cache manager: local hits, pulls from a named or discovered peer, dead sources,
contradictory parameters, saves and the per-request report."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import itertools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvmesh_apps.fleet import Fleet
from kvmesh.hashing import BlockHasher
from kvmesh.namespace import CacheConfig, Namespace

from data_plane.client import DataPlaneClient, SharedTier
from engine_connector.config import KV_LAYOUT, ConnectorConfig
from engine_connector.node_link import NodeLink
from engine_connector.scheduler_side import SchedulerSide

BS = 32
_ids = itertools.count()


def namespace(fleet: Fleet) -> Namespace:
    return Namespace(fleet.tenant, "tiny", "rev1", CacheConfig(block_size=BS, kv_dtype="float32",
                                                               kv_layout=KV_LAYOUT)).validate()


@dataclass
class FakeRequest:
    """What the scheduler side reads of vLLM's Request; hashes are vLLM's (kvmesh.hashing)."""

    num_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    block_hashes: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        base = 10_000 * next(_ids)
        self.block_hashes = BlockHasher().block_hashes(list(range(base, base + self.num_tokens)), BS)


class FakeBlocks:
    def __init__(self, block_ids: list[int]) -> None:
        self._ids = block_ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self._ids,)


def store(fleet: Fleet, node: str, hashes: list[bytes]) -> None:
    """Save blocks on ``node`` the way an engine does: Reserve, write the slots, Commit."""

    async def run() -> None:
        async with DataPlaneClient(fleet.data_planes[node].address, key=fleet.node_keys[node],
                                   tls=fleet.client_tls(f"engine-{node}")) as client:
            tier = SharedTier.open(await client.describe_tier())
            for i, slot in enumerate(await client.reserve(namespace(fleet), hashes)):
                tier.slot(slot)[:] = np.uint8(i + 1)
            tier.close()
            await client.commit(namespace(fleet), hashes)

    asyncio.run(run())


@pytest.fixture
def side(small_fleet: Fleet):
    """A SchedulerSide of an engine on dp2 (factory: keyword overrides of the connector config)."""
    links = []

    def make(**overrides) -> SchedulerSide:
        extra = {**small_fleet.connector_config("dp2"), **overrides}
        config = ConnectorConfig.from_extra_config(extra)
        link = NodeLink(config.data_plane_address, config.key(), config.control_plane_address,  # as the connector
                        tls=config.tls(config.data_plane_tls_name),
                        control_plane_tls=config.tls(config.control_plane_tls_name))
        links.append(link)
        s = SchedulerSide(link, namespace(small_fleet), config, BS, can_load=True, can_save=True)
        s.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: (list(range(100, 200)),)))
        return s

    yield make
    for link in links:
        link.close()


def matched(s: SchedulerSide, request: FakeRequest, num_computed_tokens: int, timeout_s: float = 20.0) -> int:
    """Ask the way vLLM does, once per step, until the background lookup answers."""
    deadline = time.monotonic() + timeout_s
    while (tokens := s.num_new_matched_tokens(request, num_computed_tokens)) is None:
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.01)
    return tokens


def source(fleet: Fleet, node: str, with_node_id: bool = True) -> dict[str, Any]:
    host, port = fleet.data_planes[node].address.rsplit(":", 1)
    src = {"kv_request_id": "prev", "remote_host": host, "remote_port": int(port)}
    return {**src, "remote_node_id": node} if with_node_id else src


def test_pull_from_named_source_then_pinned_slots_go_to_the_worker(small_fleet: Fleet, side) -> None:
    s = side()
    request = FakeRequest(6 * BS + 5, {"remote_kv_source": source(small_fleet, "dp1")})
    store(small_fleet, "dp1", request.block_hashes[:4])

    assert matched(s, request, 0) == 4 * BS
    s.after_alloc(request, FakeBlocks(list(range(100, 107))), 4 * BS)
    request.num_computed_tokens = 4 * BS  # vLLM counts the loaded tokens as computed
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={request.request_id: 2 * BS + 5}))

    assert [load.block_id for load in meta.loads] == [100, 101, 102, 103]
    assert len(set(load.slot for load in meta.loads)) == 4 and len(meta.leases) == 1
    # The blocks computed in this step (4, 5) are saved; the loaded ones are already in the tier.
    assert [(run.first_index, run.block_ids) for run in meta.saves] == [(4, [104, 105])]
    report = s.finished(request)[1]["kvmesh"]
    assert report["peer_tokens"] == 4 * BS and report["local_tokens"] == 0
    assert report["outcome"] == "pulled" and report["source"] == "dp1" and report["bytes_pulled"] == 4 * 1024


def test_second_request_hits_the_local_tier_without_pulling(small_fleet: Fleet, side) -> None:
    s = side()
    first = FakeRequest(3 * BS, {"remote_kv_source": source(small_fleet, "dp1")})
    store(small_fleet, "dp1", first.block_hashes)
    assert matched(s, first, 0) == 2 * BS  # the last block holds the token to compute
    s.finished(first)[1]

    again = FakeRequest(3 * BS)
    again.block_hashes = first.block_hashes
    assert matched(s, again, 0) == 2 * BS
    s.after_alloc(again, FakeBlocks([1, 2, 3, 4]), 2 * BS)
    report = s.finished(again)[1]["kvmesh"]
    assert report["local_tokens"] == 2 * BS and report["peer_tokens"] == 0 and report["outcome"] == "hit"


def test_source_without_node_id_is_resolved_through_the_control_plane(small_fleet: Fleet, side) -> None:
    s = side()
    request = FakeRequest(3 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1", with_node_id=False)})
    store(small_fleet, "dp1", request.block_hashes[:2])
    assert matched(s, request, 0) == 2 * BS
    assert s.finished(request)[1]["kvmesh"]["source"] == "dp1"


def test_auto_source_pulls_from_the_holder_the_control_plane_names(small_fleet: Fleet, side) -> None:
    s = side(auto_source=True)
    request = FakeRequest(5 * BS + 1)
    store(small_fleet, "dp1", request.block_hashes)  # dp1 publishes BlockStored to the control plane
    for _ in range(50):  # events are asynchronous
        if matched(s, request, 0) == 5 * BS:
            break
        s.after_alloc(request, FakeBlocks([]), 0)  # vLLM admits it without external tokens; ask anew
        time.sleep(0.1)
    report = s.finished(request)[1]["kvmesh"]
    assert report["source"] == "dp1" and report["peer_tokens"] == 0  # counted at allocation, none here
    assert report["outcome"] == "pulled"


def test_a_dead_source_loads_nothing_and_never_raises(small_fleet: Fleet, side) -> None:
    s = side()
    dead = {"kv_request_id": "x", "remote_host": "127.0.0.1", "remote_port": 1, "remote_node_id": "dp1"}
    request = FakeRequest(3 * BS + 1, {"remote_kv_source": dead})
    assert matched(s, request, 0) == 0
    report = s.finished(request)[1]["kvmesh"]
    assert report["outcome"] in ("pull_missed", "miss") and report["loaded_tokens"] == 0


def test_contradictory_params_run_the_request_without_transfers(small_fleet: Fleet, side) -> None:
    s = side()
    request = FakeRequest(3 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1"),
                                       "remote_prefiller": source(small_fleet, "dp1")})
    assert matched(s, request, 0) == 0
    s.after_alloc(request, FakeBlocks([1, 2, 3, 4]), 0)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={request.request_id: 3 * BS + 1}))
    assert meta.saves == [] and meta.loads == []
    report = s.finished(request)[1]["kvmesh"]
    assert report["outcome"] == "rejected" and "contradictory" in report["error"]


def test_decoder_gets_a_source_naming_this_node(small_fleet: Fleet, side) -> None:
    s = side(max_offload_tokens=BS)  # the cap does not apply to blocks kept for a decoder
    request = FakeRequest(3 * BS + 1, {"remote_decoder": {"kv_request_id": "dec-1"},
                                       "remote_kv_source": source(small_fleet, "dp1")})
    matched(s, request, 0)
    s.after_alloc(request, FakeBlocks([1, 2, 3, 4]), 0)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={request.request_id: 3 * BS + 1}))
    assert [run.block_ids for run in meta.saves] == [[100, 101, 102]]
    out = s.finished(request)[1]
    host, port = small_fleet.data_planes["dp2"].address.rsplit(":", 1)
    assert out["remote_kv_source"] == {"kv_request_id": "dec-1", "remote_host": host, "remote_port": int(port),
                                       "remote_node_id": "dp2", "cached_tokens": 3 * BS}


def test_offload_cap_and_load_tiers(small_fleet: Fleet, side) -> None:
    s = side()
    request = FakeRequest(4 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1"), "kv_load_tiers": "cpu:local",
                                       "kvmesh": {"max_offload_tokens": 2 * BS}})
    store(small_fleet, "dp1", request.block_hashes)
    assert matched(s, request, 0) == 0  # peers are not an allowed tier: no pull
    s.after_alloc(request, FakeBlocks([1, 2, 3, 4, 5]), 0)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={request.request_id: 4 * BS + 1}))
    assert [run.block_ids for run in meta.saves] == [[100, 101]]
    assert s.finished(request)[1]["kvmesh"]["outcome"] == "miss"


def test_failed_loads_are_saved_again_after_recompute(small_fleet: Fleet, side) -> None:
    s = side()
    request = FakeRequest(3 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1")})
    store(small_fleet, "dp1", request.block_hashes)
    s.after_alloc(request, FakeBlocks([7, 8, 9, 10]), matched(s, request, 0))
    s.build_meta(SimpleNamespace(num_scheduled_tokens={request.request_id: BS + 1}))
    s.on_connector_output(SimpleNamespace(finished_recving=set(), invalid_block_ids={8}))
    request.num_computed_tokens = BS  # vLLM truncates at the failed block
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={request.request_id: 2 * BS + 1}))
    assert [run.block_ids for run in meta.saves] == [[101, 102]]
    assert s.finished(request)[1]["kvmesh"]["failed_blocks"] == 1


@contextlib.contextmanager
def frozen(fleet: Fleet, node: str):
    """The node's data plane stopped (SIGSTOP) inside the block, resumed after."""
    proc = fleet.data_planes[node].proc
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def test_asks_never_wait_and_the_answer_comes_on_a_later_ask(small_fleet: Fleet, side) -> None:
    s = side()
    request = FakeRequest(5 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1")})
    store(small_fleet, "dp1", request.block_hashes[:5])
    started = time.perf_counter()
    assert s.num_new_matched_tokens(request, 0) is None  # the pull started in the background
    assert time.perf_counter() - started < 0.5
    assert matched(s, request, 0) == 5 * BS
    assert s.num_new_matched_tokens(request, 0) == 5 * BS  # asked again before allocation: the same pins
    s.after_alloc(request, FakeBlocks(list(range(10, 16))), 5 * BS)
    meta = s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert [load.block_id for load in meta.loads] == [10, 11, 12, 13, 14]
    # The worker is still copying: vLLM must keep the blocks if the request ends now.
    delay, out = s.finished(request)
    assert delay and out["kvmesh"]["peer_tokens"] == 5 * BS and out["kvmesh"]["wait_ms"] > 0
    stats = s.stats.take()
    assert stats.data["peer_tokens"] == 5 * BS and stats.data["pulls"] == 1 and stats.data["bytes_pulled"] == 5 * 1024
    assert s.stats.take() is None  # the next interval starts empty


def test_finished_loads_let_vllm_free_the_blocks_at_once(small_fleet: Fleet, side) -> None:
    s = side()
    request = FakeRequest(2 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1")})
    store(small_fleet, "dp1", request.block_hashes[:2])
    s.after_alloc(request, FakeBlocks([3, 4, 5]), matched(s, request, 0))
    s.build_meta(SimpleNamespace(num_scheduled_tokens={}))
    s.on_connector_output(SimpleNamespace(finished_recving={request.request_id}, invalid_block_ids=set()))
    s.after_alloc(request, FakeBlocks([3, 4, 5]), 0)  # vLLM's second call once the load is done
    assert s.finished(request)[0] is False


def test_frozen_source_falls_back_within_the_pull_deadline_and_asks_stay_instant(small_fleet: Fleet, side) -> None:
    deadline_ms = 1500
    s = side(pull_timeout_ms=deadline_ms)
    request = FakeRequest(4 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1")})
    store(small_fleet, "dp1", request.block_hashes[:4])
    slowest_ask = 0.0
    with frozen(small_fleet, "dp1"):
        started = time.perf_counter()
        while True:
            ask = time.perf_counter()
            tokens = s.num_new_matched_tokens(request, 0)
            slowest_ask = max(slowest_ask, time.perf_counter() - ask)
            if tokens is not None:
                break
            assert time.perf_counter() - started < 10, "no fallback"
            time.sleep(0.01)
        fallback_s = time.perf_counter() - started
    assert tokens == 0
    assert deadline_ms / 1e3 * 0.9 <= fallback_s <= deadline_ms / 1e3 + 1.0
    assert slowest_ask < 0.25  # each ask is a poll, not a wait on the frozen peer
    report = s.finished(request)[1]["kvmesh"]
    # The connector's deadline and the data plane's bound of the Pull are equal: either one ends the wait.
    assert report["outcome"] in ("deadline", "pull_failed", "pull_missed") and report["loaded_tokens"] == 0
    # Positive control: with the source running again the same prefix is pulled (the node may first have to
    # notice that its connection to the frozen peer died and reconnect: a few asks).
    again = FakeRequest(4 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1")})
    again.block_hashes = request.block_hashes
    deadline = time.monotonic() + 15
    while (tokens := matched(s, again, 0)) != 4 * BS and time.monotonic() < deadline:
        s.after_alloc(again, FakeBlocks([]), 0)  # vLLM admitted it without a load; the next request asks anew
        time.sleep(0.5)
    assert tokens == 4 * BS


def test_a_request_that_ends_during_its_pull_leaves_nothing_pinned(small_fleet: Fleet, side) -> None:
    s = side()
    request = FakeRequest(3 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1")})
    store(small_fleet, "dp1", request.block_hashes[:3])
    assert s.num_new_matched_tokens(request, 0) is None
    assert s.finished(request)[0] is False  # nothing was allocated: vLLM frees at once
    # The same request id asks again later (a new request): a fresh lookup, no stale answer.
    again = FakeRequest(3 * BS + 1, {"remote_kv_source": source(small_fleet, "dp1")})
    again.block_hashes = request.block_hashes
    assert matched(s, again, 0) == 3 * BS


def test_a_prompt_longer_than_a_lookup_loads_its_leading_blocks(small_fleet: Fleet, side) -> None:
    """Found in review: the lookup named every block of the prompt, and a data plane refuses more than its
    max_hashes_per_request (4,096): a prompt of 4,097 blocks or more (131k tokens at block 32) never loaded
    anything, its prefix always computed. A lookup names the leading max_lookup_blocks; control: a smaller
    max_lookup_blocks loads that many."""
    request = FakeRequest(4100 * BS)
    store(small_fleet, "dp2", request.block_hashes[:4])
    assert matched(side(), request, 0) == 4 * BS
    s = side(max_lookup_blocks=2)
    again = FakeRequest(4100 * BS)
    again.block_hashes = request.block_hashes
    assert matched(s, again, 0) == 2 * BS
