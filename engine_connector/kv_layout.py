"""Byte-level access to vLLM's paged KV cache, a step's blocks at a time, on CPU or on a GPU.

vLLM 0.32's CPU attention backend (``CPU_ATTN``) gives every attention layer its own
contiguous tensor of shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(layout ``LBHNC``); GPU backends give ``[2, num_blocks, ...]`` or ``[num_blocks, 2, ...]``
per layer. This module copies whatever lies in one block's rows as bytes, so it needs the
block index to be the leading dimension (the CPU layout, and GPU backends with the
``NHD``/blocks-first layout); anything else is refused at registration.

A data-plane slot holds the concatenation of ``kv[b]``'s bytes over the layers in
registration order. :class:`PagedKVLayout` copies a step's blocks between the tier (its
slots viewed as one ``[num_slots, block_nbytes]`` matrix) and the engine's cache with one
gather/scatter per layer over the step's block ids (numpy fancy indexing on CPU,
``index_copy_``/``index_select`` on a GPU), not a Python loop per block.

On CPU a copy is done when called. On a GPU (``kv.device.type == "cuda"``) loads are gathered
on the host into a page-locked staging buffer, then queued on a side CUDA stream (one
host -> device copy, one ``index_copy_`` per layer); :meth:`fence` returns an event to poll and
:meth:`synchronize` waits for the stream. Saves gather on the device, copy to a page-locked
buffer and scatter into the slots on the host: :meth:`read_blocks` returns once the slots hold
the bytes. The GPU path's unit tests have run on one GPU (an H200), not under a vLLM engine
(see docs/engine_connector.md). Not thread-safe; the worker connector calls it from the model
runner's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class PagedKVLayout:
    """Copies whole blocks (all layers) between vLLM's KV cache and a matrix of slots."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap the per-layer caches vLLM passes to ``register_kv_caches``.

        Layers that share one tensor (cross-layer KV sharing) are stored once.
        Raises ``ValueError`` for a layout this module does not understand.
        """
        rows: list[torch.Tensor] = []
        seen: set[int] = set()
        num_blocks: int | None = None
        device: torch.device | None = None
        for name, kv in kv_caches.items():
            if kv.data_ptr() in seen:
                continue
            seen.add(kv.data_ptr())
            if kv.device.type not in ("cpu", "cuda") or not kv.is_contiguous():
                raise ValueError(f"layer {name}: expected a contiguous CPU or CUDA tensor, got {kv.device} "
                                 f"{kv.stride()}")
            if device is None:
                device, num_blocks = kv.device, kv.shape[0]
            elif kv.shape[0] != num_blocks or kv.device != device:
                raise ValueError(f"layer {name} has {kv.shape[0]} blocks on {kv.device}, earlier layers "
                                 f"{num_blocks} on {device}")
            # Row b is block b's bytes (uint8 view aliasing the cache).
            rows.append(kv.view(torch.uint8).reshape(kv.shape[0], -1))
        if not rows or num_blocks is None or device is None:
            raise ValueError("no KV cache tensors to register")
        self.device = device
        self.num_blocks = num_blocks
        offsets = np.cumsum([0] + [r.shape[1] for r in rows]).tolist()
        self._columns = list(zip(offsets, offsets[1:]))  # each layer's bytes within a slot
        self.block_nbytes = int(offsets[-1])
        self._on_gpu = device.type == "cuda"
        if self._on_gpu:
            self._rows = rows
            self._stream = torch.cuda.Stream(device=device)
        else:
            self._views = [r.numpy() for r in rows]

    @property
    def on_gpu(self) -> bool:
        return self._on_gpu

    def write_blocks(self, block_ids: Sequence[int], slots: np.ndarray, slot_ids: Sequence[int]) -> None:
        """Overwrite block ``block_ids[i]`` in every layer with row ``slot_ids[i]`` of ``slots``
        (``[num_slots, block_nbytes]`` uint8), for all i at once.

        On a GPU the copies are queued on the side stream; :meth:`fence` tells when they landed.
        Raises ``IndexError`` (nothing copied) when an id is out of range.
        """
        blocks, rows = self._indices(block_ids, slots, slot_ids)
        if not len(blocks):
            return
        if self._on_gpu:
            staged = torch.empty((len(rows), self.block_nbytes), dtype=torch.uint8, pin_memory=True)
            torch.index_select(torch.from_numpy(slots), 0, torch.from_numpy(rows), out=staged)  # host gather
            with torch.cuda.stream(self._stream):
                on_device = staged.to(self.device, non_blocking=True)
                index = torch.from_numpy(blocks).to(self.device, non_blocking=True)
                for row, (start, end) in zip(self._rows, self._columns):
                    row.index_copy_(0, index, on_device[:, start:end])
            return
        for view, (start, end) in zip(self._views, self._columns):
            view[blocks] = slots[rows, start:end]

    def read_blocks(self, block_ids: Sequence[int], slots: np.ndarray, slot_ids: Sequence[int]) -> None:
        """Copy block ``block_ids[i]`` (all layers) into row ``slot_ids[i]`` of ``slots``, for all i at once;
        the rows hold the bytes when this returns.

        On a GPU the copies are ordered after the work already queued on the current stream (the
        forward that wrote the blocks). Raises ``IndexError`` (nothing copied) when an id is out of range.
        """
        blocks, rows = self._indices(block_ids, slots, slot_ids)
        if not len(blocks):
            return
        if self._on_gpu:
            staged = torch.empty((len(rows), self.block_nbytes), dtype=torch.uint8, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                index = torch.from_numpy(blocks).to(self.device, non_blocking=True)
                on_device = torch.empty((len(rows), self.block_nbytes), dtype=torch.uint8, device=self.device)
                for row, (start, end) in zip(self._rows, self._columns):
                    on_device[:, start:end] = row.index_select(0, index)  # device gather
                staged.copy_(on_device, non_blocking=True)
            self._stream.synchronize()
            slots[rows] = staged.numpy()  # host scatter
            return
        for view, (start, end) in zip(self._views, self._columns):
            slots[rows, start:end] = view[blocks]

    def _indices(self, block_ids: Sequence[int], slots: np.ndarray,
                 slot_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        blocks = np.asarray(block_ids, dtype=np.int64)
        rows = np.asarray(slot_ids, dtype=np.int64)
        if slots.ndim != 2 or slots.shape[1] != self.block_nbytes or slots.dtype != np.uint8:
            raise ValueError(f"slots are {slots.dtype} {slots.shape}, expected uint8 rows of {self.block_nbytes} "
                             f"bytes")
        if blocks.shape != rows.shape or blocks.ndim != 1:
            raise ValueError(f"{blocks.size} block ids for {rows.size} slots")
        if len(blocks) and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise IndexError(f"block ids {blocks.min()}..{blocks.max()} leave the cache's {self.num_blocks} blocks")
        if len(rows) and (rows.min() < 0 or rows.max() >= len(slots)):
            raise IndexError(f"slots {rows.min()}..{rows.max()} leave the tier's {len(slots)} slots")
        return blocks, rows

    def fence(self) -> Any:
        """A marker of the copies queued so far: None on CPU (they are done), else a recorded CUDA event."""
        if not self._on_gpu:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    @staticmethod
    def landed(fence: Any) -> bool:
        """Whether the copies before ``fence`` are done (never blocks)."""
        return fence is None or fence.query()

    def synchronize(self) -> None:
        """Wait for every queued copy (GPU); nothing to wait for on CPU."""
        if self._on_gpu:
            self._stream.synchronize()
