"""SchedulerSide planning against stand-ins for vLLM's Request and KV cache manager."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from engine_connector.block_store import ShmBlockStore
from engine_connector.scheduler_side import SchedulerSide

BS = 32


@dataclass
class FakeRequest:
    request_id: str
    num_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.block_hashes = [i.to_bytes(32, "big") for i in range(self.num_tokens // BS)]


class FakeBlocks:
    def __init__(self, block_ids: list[int]) -> None:
        self._ids = block_ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self._ids,)


@pytest.fixture
def store(tmp_path: Path) -> ShmBlockStore:
    s = ShmBlockStore(tmp_path, block_nbytes=64, num_slots=64)
    yield s
    s.close()


def _fill(store: ShmBlockStore, hashes: list[bytes]) -> None:
    for h in hashes:
        store.write(h, np.zeros(64, dtype=np.uint8))
    store.commit()


def test_full_prompt_hit_leaves_the_last_token_to_compute(store: ShmBlockStore) -> None:
    side = SchedulerSide(store, BS, can_load=True, can_save=True)
    request = FakeRequest("r", num_tokens=4 * BS)
    _fill(store, request.block_hashes)
    assert side.num_new_matched_tokens(request, 0) == 3 * BS
    assert side.num_new_matched_tokens(request, BS) == 2 * BS


def test_loads_follow_local_hits_and_saves_start_after_stored_blocks(store: ShmBlockStore) -> None:
    side = SchedulerSide(store, BS, can_load=True, can_save=True)
    request = FakeRequest("r", num_tokens=5 * BS + 3)
    _fill(store, request.block_hashes[:3])
    block_ids = [10, 11, 12, 13, 14, 15]
    side.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: (block_ids,)))

    assert side.num_new_matched_tokens(request, BS) == 2 * BS  # block 0 is a local hit
    side.after_alloc(request, FakeBlocks(block_ids), 2 * BS)
    request.num_computed_tokens = 3 * BS
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 2 * BS + 3}))

    assert [(t.block_id, t.block_hash) for t in meta.loads] == [(11, request.block_hashes[1]), (12, request.block_hashes[2])]
    assert [(t.block_id, t.block_hash) for t in meta.saves] == [(13, request.block_hashes[3]), (14, request.block_hashes[4])]
    assert side.finished(request) == {"kvmesh": {"loaded_tokens": 2 * BS, "failed_blocks": 0, "stored_blocks": 5}}


def test_failed_loads_are_saved_again_after_recompute(store: ShmBlockStore) -> None:
    side = SchedulerSide(store, BS, can_load=True, can_save=True)
    request = FakeRequest("r", num_tokens=3 * BS + 1)
    _fill(store, request.block_hashes)
    block_ids = [7, 8, 9, 10]
    side.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: (block_ids,)))
    side.after_alloc(request, FakeBlocks(block_ids), side.num_new_matched_tokens(request, 0))
    side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 1}))

    side.on_connector_output(SimpleNamespace(invalid_block_ids={8}))
    request.num_computed_tokens = BS  # vLLM truncates at the failed block
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 2 * BS + 1}))

    assert [t.block_id for t in meta.saves] == [8, 9]
    assert side.finished(request)["kvmesh"]["failed_blocks"] == 1


def test_kv_transfer_params_and_role_gate_loading(store: ShmBlockStore) -> None:
    request = FakeRequest("r", num_tokens=3 * BS, kv_transfer_params={"kvmesh": {"load": False}})
    _fill(store, request.block_hashes)
    assert SchedulerSide(store, BS, can_load=True, can_save=True).num_new_matched_tokens(request, 0) == 0
    request.kv_transfer_params = {"other_connector": 1, "kvmesh": "garbage"}
    assert SchedulerSide(store, BS, can_load=True, can_save=True).num_new_matched_tokens(request, 0) == 2 * BS
    assert SchedulerSide(store, BS, can_load=False, can_save=True).num_new_matched_tokens(request, 0) == 0
