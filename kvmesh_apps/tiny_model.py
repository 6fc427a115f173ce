"""Random-weight Llama checkpoints built locally, for tests and the demo.

No hub access: the weights come from a seeded ``LlamaForCausalLM`` initialiser and are
written with ``save_pretrained`` (safetensors). Engines load them with
``skip_tokenizer_init=True`` and token-id prompts, so no tokenizer is written.

Two presets (timings measured on the 2-core dev VM, fp32, vLLM 0.32 CPU, block size 32):

* :func:`build_tiny_llama` defaults: 2 layers, hidden 256, 2 KV heads of 64 (2 KiB of KV
  per token). Builds in ~4 s; a 1,200-token prefill takes well under 0.1 s. For
  correctness tests, with ``init_std=TEST_INIT_STD``: measured with Hugging Face's forward,
  chunked vs whole prefill differ by < 1e-5 in logprob, while one block's KV replaced by its
  neighbour's moves them by 2.8 (0.08 at the default init 0.02, 15 at 0.3).
* :data:`DEMO_PRESET` (``build_tiny_llama(path, **DEMO_PRESET)``): 12 layers, hidden 1024,
  16 heads over 2 KV heads, ~150M parameters (600 MB, builds in ~6 s). Prefilling a
  2,048-token prompt takes ~1.9 s; loading its 2,000-token prefix (62 blocks, 12 KiB of
  KV per token, 23 MiB) from the shared-memory store takes ~10 ms and the whole request
  ~0.1 s.

Builds are deterministic for a given seed and idempotent: a directory already holding a
build of the same spec is left alone. Not safe against two processes building the same
path at the same moment (the loser's ``rename`` fails loudly).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvmesh_apps.kv_shape import CPU_HEAD_SIZES

_STAMP = "kvmesh_tiny_model.json"


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """Everything that determines the bytes of a build."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    dtype: str
    seed: int
    init_std: float = 0.02

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> "TinyLlamaSpec":
        """The spec ``path`` was built with; ``ValueError`` if it is not a complete build."""
        stamp = _read_stamp(Path(path))
        if stamp is None:
            raise ValueError(f"{path} holds no complete build_tiny_llama checkpoint")
        return cls(**stamp)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_dim not in CPU_HEAD_SIZES:
            raise ValueError(f"head_dim {self.head_dim} is not supported by vLLM's CPU backend")


# The weight init of the test and benchmark builds: sharper than Hugging Face's default 0.02, so the model's
# predictions depend on its context (with 0.02 attention is near uniform and a wrong block barely shows).
TEST_INIT_STD = 0.1

DEMO_PRESET: dict[str, Any] = {
    "num_layers": 12,
    "hidden": 1024,
    "heads": 16,
    "kv_heads": 2,
    "intermediate": 2816,
    "vocab": 8192,
}


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 2048,
    max_positions: int = 4096,
    dtype: str = "float32",
    seed: int = 0,
    init_std: float = 0.02,
) -> Path:
    """Write a random-weight Llama checkpoint to ``path`` and return ``path``.

    ``intermediate`` defaults to ``2 * hidden``. ``dtype`` is the checkpoint and serving
    dtype (float32 keeps greedy outputs stable across batch shapes). If ``path`` already
    holds a build with the same spec nothing is written; a build with a different spec is
    replaced.
    """
    spec = TinyLlamaSpec(
        num_layers=num_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate if intermediate is not None else 2 * hidden,
        vocab=vocab,
        max_positions=max_positions,
        dtype=dtype,
        seed=seed,
        init_std=init_std,
    )
    spec.validate()
    target = Path(path)
    if _read_stamp(target) == asdict(spec):
        return target

    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    _write_checkpoint(spec, staging)
    (staging / _STAMP).write_text(json.dumps(asdict(spec), sort_keys=True))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def _read_stamp(target: Path) -> dict[str, Any] | None:
    try:
        return json.loads((target / _STAMP).read_text())
    except (OSError, ValueError):
        return None


def _write_checkpoint(spec: TinyLlamaSpec, out: Path) -> None:
    # Imported lazily: torch and transformers take seconds to import.
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        dtype=spec.dtype,
        initializer_range=spec.init_std,
    )
    torch_dtype = getattr(torch, spec.dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).to(torch_dtype)
    model.save_pretrained(out, safe_serialization=True)
