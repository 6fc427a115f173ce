"""PagedKVLayout on tensors shaped like vLLM 0.32's CPU KV cache (no engine needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_connector.kv_layout import PagedKVLayout

# [num_blocks, num_kv_heads, block_size, 2 * head_size], one tensor per layer.
SHAPE = (8, 2, 32, 128)


def _caches(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(SHAPE, generator=gen).to(dtype) for i in range(3)}


def _slots(layout: PagedKVLayout, n: int = 6) -> np.ndarray:
    """A tier of ``n`` slots, as the worker sees it (``SharedTier.slots()``), filled with a marker."""
    return np.full((n, layout.block_nbytes), 0xAB, dtype=np.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_roundtrip_between_engines_through_slots(dtype: torch.dtype) -> None:
    src, dst = _caches(0, dtype), _caches(1, dtype)
    src_layout, dst_layout = PagedKVLayout(src), PagedKVLayout(dst)
    assert src_layout.block_nbytes == 3 * 2 * 32 * 128 * dtype.itemsize
    slots = _slots(src_layout)

    src_layout.read_blocks([3, 0, 6], slots, [4, 1, 2])  # one step's saves, in no particular order
    dst_layout.write_blocks([5, 7, 1], slots, [4, 2, 1])  # loads into other blocks

    for name in src:
        assert torch.equal(dst[name][5], src[name][3])
        assert torch.equal(dst[name][7], src[name][6])
        assert torch.equal(dst[name][1], src[name][0])
        assert not torch.equal(dst[name][4], src[name][3])  # untouched blocks keep their bytes
    assert (slots[[0, 3, 5]] == 0xAB).all(), "slots not named were not written"


def test_a_slot_holds_each_layers_block_bytes_in_registration_order() -> None:
    caches = _caches(0)
    layout = PagedKVLayout(caches)
    slots = _slots(layout)
    layout.read_blocks([2], slots, [0])
    expected = np.concatenate([kv[2].view(torch.uint8).flatten().numpy() for kv in caches.values()])
    assert np.array_equal(slots[0], expected)


def test_shared_layer_tensors_are_stored_once() -> None:
    caches = _caches(0)
    first = next(iter(caches.values()))
    caches["model.layers.3.self_attn.attn"] = first
    assert PagedKVLayout(caches).block_nbytes == 3 * 2 * 32 * 128 * 4


def test_non_contiguous_cache_is_rejected() -> None:
    caches = {"layer": torch.zeros(SHAPE).transpose(1, 2)}
    with pytest.raises(ValueError, match="contiguous"):
        PagedKVLayout(caches)


def test_out_of_range_ids_copy_nothing() -> None:
    caches = _caches(0)
    layout = PagedKVLayout(caches)
    before = {name: kv.clone() for name, kv in caches.items()}
    slots = _slots(layout)
    with pytest.raises(IndexError):
        layout.write_blocks([1, SHAPE[0]], slots, [0, 1])
    with pytest.raises(IndexError):
        layout.write_blocks([1, 2], slots, [0, len(slots)])
    with pytest.raises(ValueError):
        layout.write_blocks([1], slots[:, 1:], [0])  # rows that are not one block's bytes
    assert all(torch.equal(caches[name], before[name]) for name in caches)
    layout.write_blocks([1, 2], slots, [0, 1])  # positive control: in range, copied
    assert all(torch.equal(caches[name][1].view(torch.uint8), torch.full_like(caches[name][1].view(torch.uint8),
                                                                             0xAB)) for name in caches)


def test_cpu_copies_are_done_when_called() -> None:
    layout = PagedKVLayout(_caches(0))
    assert not layout.on_gpu and layout.fence() is None and PagedKVLayout.landed(layout.fence())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU path is not run on CPU hosts)")
def test_gpu_copies_land_after_their_fence() -> None:
    src = _caches(0)
    gpu = {name: torch.zeros(SHAPE, device="cuda") for name in src}
    layout, host = PagedKVLayout(gpu), PagedKVLayout(src)
    slots = _slots(host)
    host.read_blocks([1, 4], slots, [0, 3])
    layout.write_blocks([2, 6], slots, [0, 3])
    fence = layout.fence()
    torch.cuda.synchronize()
    assert PagedKVLayout.landed(fence)
    for name in src:
        assert torch.equal(gpu[name][2].cpu(), src[name][1]) and torch.equal(gpu[name][6].cpu(), src[name][4])
    back = _slots(host)
    layout.read_blocks([6, 2], back, [5, 1])  # the slots hold the bytes when it returns
    assert np.array_equal(back[1], slots[0]) and np.array_equal(back[5], slots[3])
