"""Byte-level access to vLLM's paged KV cache on CPU, one block at a time.

vLLM 0.32's CPU attention backend (``CPU_ATTN``) gives every attention layer its own
contiguous tensor of shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(layout ``LBHNC``). Viewed as ``[num_blocks, num_kv_heads, 2 * block_size, head_size]``,
rows ``0..block_size-1`` of each head are K and the rest are V. Block ``b`` of a layer is
therefore the contiguous slice ``kv[b]``.

A data-plane slot holds the concatenation of ``kv[b]``'s bytes over the layers in
registration order; :class:`PagedKVLayout` copies between that form and the engine's cache.
Not thread-safe; the worker connector calls it from the model runner's thread.
"""

from __future__ import annotations

import numpy as np
import torch


class PagedKVLayout:
    """Copies whole blocks (all layers) between vLLM's KV cache and flat byte buffers."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap the per-layer caches vLLM passes to ``register_kv_caches``.

        Layers that share one tensor (cross-layer KV sharing) are stored once.
        Raises ``ValueError`` for a layout this module does not understand.
        """
        views: list[np.ndarray] = []
        seen: set[int] = set()
        num_blocks: int | None = None
        for name, kv in kv_caches.items():
            if kv.data_ptr() in seen:
                continue
            seen.add(kv.data_ptr())
            if kv.device.type != "cpu" or not kv.is_contiguous():
                raise ValueError(f"layer {name}: expected a contiguous CPU tensor, got {kv.device} {kv.stride()}")
            if num_blocks is None:
                num_blocks = kv.shape[0]
            elif kv.shape[0] != num_blocks:
                raise ValueError(f"layer {name} has {kv.shape[0]} blocks, earlier layers {num_blocks}")
            # A uint8 numpy view aliasing the cache: row b is block b's bytes.
            views.append(kv.view(torch.uint8).reshape(kv.shape[0], -1).numpy())
        if not views or num_blocks is None:
            raise ValueError("no KV cache tensors to register")
        self._views = views
        self._offsets = np.cumsum([0] + [v.shape[1] for v in views]).tolist()
        self.num_blocks = num_blocks
        self.block_nbytes = int(self._offsets[-1])

    def read_block(self, block_id: int, out: np.ndarray | None = None) -> np.ndarray:
        """Copy block ``block_id`` for all layers into ``out`` (``block_nbytes`` bytes; a new array if None)."""
        if out is None:
            out = np.empty(self.block_nbytes, dtype=np.uint8)
        elif out.nbytes != self.block_nbytes:
            raise ValueError(f"buffer is {out.nbytes} bytes, cache blocks are {self.block_nbytes}")
        for view, start, end in zip(self._views, self._offsets, self._offsets[1:]):
            out[start:end] = view[block_id]
        return out

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        """Overwrite block ``block_id`` in every layer with ``data`` (``block_nbytes`` bytes)."""
        if data.nbytes != self.block_nbytes:
            raise ValueError(f"block data is {data.nbytes} bytes, cache blocks are {self.block_nbytes}")
        for view, start, end in zip(self._views, self._offsets, self._offsets[1:]):
            view[block_id] = data[start:end]
