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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_roundtrips_between_engines(dtype: torch.dtype) -> None:
    src, dst = _caches(0, dtype), _caches(1, dtype)
    src_layout, dst_layout = PagedKVLayout(src), PagedKVLayout(dst)
    assert src_layout.block_nbytes == 3 * 2 * 32 * 128 * dtype.itemsize

    dst_layout.write_block(5, src_layout.read_block(3))

    for name in src:
        assert torch.equal(dst[name][5], src[name][3])
        assert not torch.equal(dst[name][4], src[name][3])


def test_shared_layer_tensors_are_stored_once() -> None:
    caches = _caches(0)
    first = next(iter(caches.values()))
    caches["model.layers.3.self_attn.attn"] = first
    assert PagedKVLayout(caches).block_nbytes == 3 * 2 * 32 * 128 * 4


def test_non_contiguous_cache_is_rejected() -> None:
    caches = {"layer": torch.zeros(SHAPE).transpose(1, 2)}
    with pytest.raises(ValueError, match="contiguous"):
        PagedKVLayout(caches)


def test_read_block_returns_a_copy() -> None:
    caches = _caches(0)
    layout = PagedKVLayout(caches)
    data = layout.read_block(0)
    data[:] = 0
    assert np.any(layout.read_block(0))


def test_cpu_copies_are_done_when_called() -> None:
    layout = PagedKVLayout(_caches(0))
    assert not layout.on_gpu and layout.fence() is None and PagedKVLayout.landed(layout.fence())
    with pytest.raises(IndexError):
        layout.write_block(SHAPE[0], layout.read_block(0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU path is not run on CPU hosts)")
def test_gpu_copies_land_after_their_fence() -> None:
    src = _caches(0)
    gpu = {name: torch.zeros(SHAPE, device="cuda") for name in src}
    layout, host = PagedKVLayout(gpu), PagedKVLayout(src)
    layout.write_block(2, host.read_block(1))
    fence = layout.fence()
    torch.cuda.synchronize()
    assert PagedKVLayout.landed(fence)
    for name in src:
        assert torch.equal(gpu[name][2].cpu(), src[name][1])
    out = layout.read_block(2)
    layout.synchronize()
    assert np.array_equal(out, host.read_block(1))
