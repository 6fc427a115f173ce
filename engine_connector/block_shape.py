"""One engine KV block in bytes, and the startup error when the node's data-plane slots differ.

A data-plane slot holds exactly one engine block (all layers, kv_layout.py), so the sizes must
be equal (and the block sizes, when the data plane fixes one); the connector checks it when the
engine starts (both roles) and again when the worker adopts the KV cache. The error names the
engine's block bytes and block size and how to start a fleet that matches (``kvmesh up
--block-bytes N --block-tokens M``, or ``kvmesh up --model PATH --dtype D --block-tokens M``,
which derives the same number from the checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class SlotSizeMismatch(ValueError):
    """The node's data plane has slots of another size than this engine's KV blocks."""


def engine_block_nbytes(kv_cache_config: "KVCacheConfig") -> int:
    """Bytes of one block across all layers: the data plane's slot size must equal it."""
    if len(kv_cache_config.kv_cache_groups) != 1:
        raise ValueError(
            f"KvmeshConnector supports one KV cache group, the model has {len(kv_cache_config.kv_cache_groups)}"
        )
    (group,) = kv_cache_config.kv_cache_groups
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)


_SPLITTING = ("tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size",
              "decode_context_parallel_size")


def one_worker(vllm_config: "VllmConfig") -> None:
    """Refuses an engine whose KV blocks are split over workers (tensor, pipeline or context parallel): each
    worker would save its part under the same block hashes into the node's one slot, the first in kept, and a
    load would copy that worker's heads (or layers) into every worker: wrong KV, silently."""
    parallel = getattr(vllm_config, "parallel_config", None)
    split = {name: getattr(parallel, name, 1) for name in _SPLITTING}
    split = {name: n for name, n in split.items() if isinstance(n, int) and n > 1}
    if split:
        sizes = ", ".join(f"{name}={n}" for name, n in split.items())
        raise ValueError(f"KvmeshConnector: one worker per engine only ({sizes}): a slot holds a whole block and "
                         "each worker would store its part of it under the same hashes; start the engine with "
                         "--tensor-parallel-size 1 --pipeline-parallel-size 1 (docs/engine_connector.md, limits)")


@dataclass(frozen=True, slots=True)
class EngineBlocks:
    """What the remedy of a mismatch needs to say about this engine."""

    block_tokens: int
    model: str = ""
    dtype: str = ""  # the model dtype vLLM serves in, e.g. bfloat16
    kv_cache_dtype: str = "auto"

    @classmethod
    def of(cls, vllm_config: "VllmConfig") -> "EngineBlocks":
        """ValueError (one line) for an engine whose blocks are split over workers (see :func:`one_worker`)."""
        one_worker(vllm_config)
        model = vllm_config.model_config
        return cls(vllm_config.cache_config.block_size, str(model.model), str(model.dtype).removeprefix("torch."),
                   str(vllm_config.cache_config.cache_dtype))

    def check(self, address: str, slot_bytes: int, engine_bytes: int, slot_tokens: int = 0) -> None:
        """Raise :class:`SlotSizeMismatch` (a one-line remedy) unless the slots hold exactly one block.

        ``slot_tokens``: the tokens per block the data plane stores (0: any); with another number every
        request would be refused (INVALID_ARGUMENT), so that too fails at start.
        """
        if slot_bytes == engine_bytes and slot_tokens in (0, self.block_tokens):
            return
        exact = f"--block-bytes {engine_bytes} --block-tokens {self.block_tokens}"
        derived = ""
        if self.model:
            kv = f" --kv-cache-dtype {self.kv_cache_dtype}" if self.kv_cache_dtype != "auto" else ""
            dtype = f" --dtype {self.dtype}" if self.dtype else ""
            derived = f", or `kvmesh up --model {self.model}{dtype}{kv} --block-tokens {self.block_tokens}`"
        tokens = f" of {slot_tokens}-token blocks" if slot_tokens else ""
        raise SlotSizeMismatch(
            f"KvmeshConnector: the data plane at {address} has {slot_bytes}-byte slots{tokens} but this engine's KV "
            f"blocks are {engine_bytes} bytes ({self.block_tokens} tokens"
            f"{', ' + self.dtype if self.dtype else ''}); a slot must hold exactly one block. Start a matching "
            f"fleet: `kvmesh up {exact}`{derived}; or start each data plane with {exact} "
            f"(KVMESH_DP_BLOCK_BYTES={engine_bytes} KVMESH_DP_BLOCK_TOKENS={self.block_tokens})")
