"""Byte-level access to vLLM's paged KV cache, one block at a time, on CPU or on a GPU.

vLLM 0.32's CPU attention backend (``CPU_ATTN``) gives every attention layer its own
contiguous tensor of shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(layout ``LBHNC``); GPU backends give ``[2, num_blocks, ...]`` or ``[num_blocks, 2, ...]``
per layer. This module copies whatever lies in one block's rows as bytes, so it needs the
block index to be the leading dimension (the CPU layout, and GPU backends with the
``NHD``/blocks-first layout); anything else is refused at registration.

A data-plane slot holds the concatenation of ``kv[b]``'s bytes over the layers in
registration order; :class:`PagedKVLayout` copies between that form and the engine's cache.

On CPU a copy is a ``memcpy`` done when called. On a GPU (``kv.device.type == "cuda"``) copies
are queued on a side CUDA stream (host slots <-> device rows, asynchronous when the host
memory is page-locked: the worker registers the tier's mapping with ``cudaHostRegister``);
:meth:`fence` returns an event to poll and :meth:`synchronize` waits for the stream. The GPU
path was written against the PyTorch CUDA API and has not been run on a GPU (see
docs/engine_connector.md). Not thread-safe; the worker connector calls it from the model
runner's thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class PagedKVLayout:
    """Copies whole blocks (all layers) between vLLM's KV cache and flat byte buffers."""

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
        self._offsets = np.cumsum([0] + [r.shape[1] for r in rows]).tolist()
        self.block_nbytes = int(self._offsets[-1])
        self._on_gpu = device.type == "cuda"
        if self._on_gpu:
            self._rows = rows
            self._stream = torch.cuda.Stream(device=device)
        else:
            self._views = [r.numpy() for r in rows]

    @property
    def on_gpu(self) -> bool:
        return self._on_gpu

    def read_block(self, block_id: int, out: np.ndarray | None = None) -> np.ndarray:
        """Copy block ``block_id`` for all layers into ``out`` (``block_nbytes`` bytes; a new array if None).

        On a GPU the copy is queued after the work already queued on the current stream (the
        forward that wrote the block); call :meth:`synchronize` before reading ``out``.
        """
        if out is None:
            out = np.empty(self.block_nbytes, dtype=np.uint8)
        elif out.nbytes != self.block_nbytes:
            raise ValueError(f"buffer is {out.nbytes} bytes, cache blocks are {self.block_nbytes}")
        if self._on_gpu:
            host = torch.from_numpy(out)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for row, start, end in zip(self._rows, self._offsets, self._offsets[1:]):
                    host[start:end].copy_(row[block_id], non_blocking=True)
            return out
        for view, start, end in zip(self._views, self._offsets, self._offsets[1:]):
            out[start:end] = view[block_id]
        return out

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        """Overwrite block ``block_id`` in every layer with ``data`` (``block_nbytes`` bytes).

        On a GPU the copy is queued on the side stream; :meth:`fence` tells when it landed.
        """
        if data.nbytes != self.block_nbytes:
            raise ValueError(f"block data is {data.nbytes} bytes, cache blocks are {self.block_nbytes}")
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside the cache's {self.num_blocks} blocks")
        if self._on_gpu:
            host = torch.from_numpy(data)
            with torch.cuda.stream(self._stream):
                for row, start, end in zip(self._rows, self._offsets, self._offsets[1:]):
                    row[block_id].copy_(host[start:end], non_blocking=True)
            return
        for view, start, end in zip(self._views, self._offsets, self._offsets[1:]):
            view[block_id] = data[start:end]

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


def pin_host_memory(address: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` at ``address`` for the CUDA driver (``cudaHostRegister``) so device copies from and
    to it run asynchronously; False (copies stay correct, only synchronous) when CUDA is absent or refuses."""
    if not torch.cuda.is_available():
        return False
    result = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    return int(result) == 0
