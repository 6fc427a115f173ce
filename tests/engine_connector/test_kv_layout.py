"""PagedKVLayout on tensors shaped like vLLM 0.32's CPU KV cache (no engine needed)."""

from __future__ import annotations

import time

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


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the GPU path is not run on CPU hosts)")


@needs_cuda
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


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_loads_and_saves_give_the_bytes_the_cpu_path_gives(dtype: torch.dtype) -> None:
    """The same steps of loads and saves, in random order, on a GPU cache and on a CPU cache: the caches and the
    slots end byte for byte alike; each step's loads are polled through their fence (no synchronize)."""
    rng = np.random.default_rng(7)
    cpu = _caches(2, dtype)
    gpu = {name: kv.to("cuda") for name, kv in cpu.items()}
    on_cpu, on_gpu = PagedKVLayout(cpu), PagedKVLayout(gpu)
    assert on_gpu.on_gpu and on_gpu.block_nbytes == on_cpu.block_nbytes
    slots_cpu = rng.integers(0, 256, (12, on_cpu.block_nbytes), dtype=np.uint8)
    slots_gpu = slots_cpu.copy()
    for _ in range(5):
        loads = rng.permutation(SHAPE[0])[:5].tolist()
        load_slots = rng.permutation(len(slots_cpu))[:5].tolist()
        on_cpu.write_blocks(loads, slots_cpu, load_slots)
        on_gpu.write_blocks(loads, slots_gpu, load_slots)
        assert _there_once_fenced(on_gpu.fence(), gpu, cpu, loads)
        saves = rng.permutation(SHAPE[0])[:4].tolist()
        save_slots = rng.permutation(len(slots_cpu))[:4].tolist()
        on_cpu.read_blocks(saves, slots_cpu, save_slots)
        on_gpu.read_blocks(saves, slots_gpu, save_slots)
        assert np.array_equal(slots_gpu, slots_cpu)
    for name in cpu:
        assert torch.equal(gpu[name].cpu().view(torch.uint8), cpu[name].view(torch.uint8))


def _there_once_fenced(fence, gpu: dict[str, torch.Tensor], cpu: dict[str, torch.Tensor], blocks: list[int]) -> bool:
    """Whether ``blocks`` of the GPU cache hold the CPU cache's bytes when read as soon as ``fence`` says the loads
    landed, with no synchronize."""
    waited_until = time.monotonic() + 10.0
    while not PagedKVLayout.landed(fence):
        assert time.monotonic() < waited_until, "the fence never reported the loads landed"
    return all(torch.equal(gpu[name][blocks].cpu().view(torch.uint8), cpu[name][blocks].view(torch.uint8))
               for name in cpu)


@needs_cuda
@pytest.mark.parametrize("fenced_on", ["side stream", "current stream"])
def test_slow_loads_are_there_once_their_fence_says_so(fenced_on: str) -> None:
    """Loads held back ~150 ms on the side stream (a sleep kernel ahead of them) are there when the layout's fence
    says so; the same check reading behind a fence recorded on the current stream instead finds them missing (the
    check can fail)."""
    cpu = _caches(3)
    gpu = {name: torch.zeros(SHAPE, device="cuda") for name in cpu}
    layout, host = PagedKVLayout(gpu), PagedKVLayout(cpu)
    slots = _slots(host)
    host.read_blocks([1, 5], slots, [0, 2])
    torch.cuda.synchronize()
    with torch.cuda.stream(layout._stream):
        torch.cuda._sleep(300_000_000)
    layout.write_blocks([1, 5], slots, [0, 2])
    if fenced_on == "side stream":
        assert _there_once_fenced(layout.fence(), gpu, cpu, [1, 5])
    else:
        wrong = torch.cuda.Event()
        wrong.record(torch.cuda.current_stream())
        assert not _there_once_fenced(wrong, gpu, cpu, [1, 5])
    layout.synchronize()
    assert _there_once_fenced(layout.fence(), gpu, cpu, [1, 5])


@needs_cuda
def test_a_gpu_save_waits_for_the_forward_that_wrote_the_block() -> None:
    """The forward writes a block on the current stream (here: after a sleep kernel); a save of that block
    queued right after must copy what the forward wrote, not what was there before."""
    gpu = {name: torch.zeros(SHAPE, device="cuda") for name in _caches(0)}
    layout = PagedKVLayout(gpu)
    slots = np.zeros((4, layout.block_nbytes), dtype=np.uint8)
    layout.read_blocks([3], slots, [2])  # warm: the buffers a save takes are cached (allocating one may synchronize)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # on the current stream, ahead of the write below
    for kv in gpu.values():
        kv[3].fill_(7.0)
    layout.read_blocks([3], slots, [1])
    expected = np.concatenate([torch.full(SHAPE[1:], 7.0).view(torch.uint8).flatten().numpy() for _ in gpu])
    assert np.array_equal(slots[1], expected)
    assert not slots[0].any() and not slots[2].any()  # control: the bytes before the forward's write
