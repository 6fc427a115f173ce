"""The bytes of one vLLM KV block, derived from a Hugging Face checkpoint's ``config.json``.

A data plane's slot must be exactly one engine KV block (all layers); the connector refuses a
data plane whose slots differ (engine_connector/block_shape.py). ``kvmesh up --model``, the
demo and the benchmarks size their data planes with :class:`KVShape` instead of a constant.

The rules are vLLM 0.32's on CPU (x86-64 and aarch64 Linux), read in its source:

* model dtype (``vllm/config/model.py``, ``_get_and_verify_dtype`` / ``_resolve_auto_dtype``):
  ``--dtype auto`` takes the checkpoint's dtype (config.json ``dtype`` or ``torch_dtype``, else
  the safetensors weights', else float32), and the CPU platform's preferred dtype replaces a
  **float32** checkpoint: it is served in **bfloat16**. float16 and bfloat16 checkpoints keep
  their dtype (``CpuPlatform.supported_dtypes`` holds both), except float16 for gemma2/gemma3/
  glm4, which falls back to bfloat16. An explicit ``--dtype`` (float32/float, float16/half,
  bfloat16) is used as given.
* KV cache dtype (``vllm/v1/attention/backends/cpu_attn.py``): ``--kv-cache-dtype auto`` is the
  model dtype; ``fp8``, ``fp8_e4m3`` and ``fp8_e5m2`` store one byte per element (head size a
  multiple of 32); the CPU backend takes no other.
* geometry (``vllm/transformers_utils/model_arch_config_convertor.py``): the text config
  (``text_config`` when present), ``num_hidden_layers``; KV heads from ``n_head_kv``, ``num_kv_heads``,
  ``num_key_value_heads``, ``multi_query_group_num`` or ``num_attention_groups``, else ``num_attention_heads``;
  head size ``head_dim`` (when positive), ``hidden_size_per_head``, else ``hidden_size // num_attention_heads``.
  Some model types name these otherwise or count KV heads by their own rule, read as their config classes do:
  GPT-2, GPT-SW3, GPT-J, GPT-BigCode (``n_layer``, ``n_head``, ``n_embd``; one KV head with BigCode's
  ``multi_query``), Bloom (``n_embed`` wins), DBRX (``n_layers``, ``n_heads``, ``d_model``, ``attn_config.kv_n_heads``),
  ChatGLM (``num_layers``, ``multi_query_group_num``), Falcon (one KV head with ``multi_query`` unless
  ``new_decoder_architecture``). The CPU backend takes head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512
  and block sizes that are multiples of 32.
* refused (give the block bytes): multi-head latent attention (``kv_lora_rank``); hybrid, attention-free and
  per-layer-geometry models (their model types, Mamba/SSM keys, ``layer_types`` other than full or sliding
  attention); and a config that omits the KV heads or ``head_dim`` unless its model type's config class is known
  to fall back as above: another class may fill in a default of its own, which vLLM reads and config.json does
  not show.

One block is ``2 (K and V) x layers x KV heads x head size x element bytes x block tokens``:
what one worker of a single-GPU/CPU engine (tensor parallel 1) holds, for plain full-attention models.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_BLOCK_ALIGN = 32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {"float": "float32", "half": "float16", **{name: name for name in DTYPE_BYTES}}
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
_NO_FLOAT16 = ("gemma2", "gemma3", "gemma3_text", "glm4")  # vLLM: numerical instability in float16
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")
# The other names some model types give the geometry (their config classes' attribute maps), read where the usual
# key is absent; only for these types: elsewhere such a name may mean something else (Mamba2's num_heads).
_GPT2_NAMES = {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "hidden_size": "n_embd"}
_ALIASES = {**dict.fromkeys(("gpt2", "gpt-sw3", "gptj", "gpt_bigcode"), _GPT2_NAMES),
            "bloom": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head"},
            "dbrx": {"num_hidden_layers": "n_layers", "num_attention_heads": "n_heads", "hidden_size": "d_model"},
            "chatglm": {"num_hidden_layers": "num_layers"}}
# The model types (of the text config) whose config classes, when config.json names no KV heads, take the
# attention heads (transformers 5.19, checked by tests/test_kv_shape.py), and those that, when it names no head_dim,
# take hidden_size // num_attention_heads. Elsewhere a class may default them to a number of its own, which vLLM
# reads and config.json does not show: such a config is refused.
_KV_HEADS_DEFAULT_TO_HEADS = frozenset((
    "afmoe", "apertus", "arcee", "bloom", "cohere", "cohere2", "cohere2_moe", "falcon", "flex_olmo", "gpt-sw3",
    "gpt2", "gpt_neox", "gptj", "granite", "granitemoe", "granitemoe_swa", "granitemoeshared", "hrm_text",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "jais2", "llama", "olmo", "olmo2", "olmo3", "olmoe", "opt", "phi", "phi3"))
_HEAD_DIM_DEFAULTS_TO_DIVISION = frozenset((
    "apertus", "arcee", "aria_text", "bloom", "chatglm", "cohere", "cohere2", "cohere_compass_text", "dbrx",
    "emu3_text_model", "ernie4_5", "ernie4_5_moe", "ernie4_5_vl_moe_text", "exaone4", "exaone_moe", "falcon",
    "flex_olmo", "glm4v_text", "glm_ocr_text", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granite",
    "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "hunyuan_v1_dense", "hunyuan_v1_moe",
    "hunyuan_vl_text", "hy_v3", "hyperclovax", "jais2", "llama", "minimax_m2", "mistral", "mixtral", "olmo",
    "olmo2", "olmo3", "olmoe", "opt", "paddleocr_vl_text", "phi", "phi3", "phimoe", "qwen2", "qwen2_5_vl_text",
    "qwen2_moe", "qwen2_vl_text", "qwen3_moe", "qwen3_vl_moe_text", "smollm3", "stablelm", "starcoder2"))
# Models whose layers are not all one full-attention shape: vLLM's hybrid (Mamba, linear attention) and
# attention-free models, and those with per-layer geometry (Gemma 4's global_head_dim). Their config types, and
# the config.json keys that give them away in types not listed.
_NOT_UNIFORM_MODEL_TYPES = frozenset((
    "bailing_moe_v2_5", "bailing_moe_v3", "bamba", "cosmos3_edge", "cosmos3_edge_text", "diffusion_gemma",
    "diffusion_gemma_text", "falcon_h1", "falcon_mamba", "gemma4", "gemma4_text", "gemma4_unified",
    "gemma4_unified_text", "granitemoehybrid", "jamba", "kimi_k3", "kimi_linear", "lfm2", "lfm2_moe", "lfm2_vl",
    "mamba", "mamba2", "minimax", "nemotron-nas", "nemotron_h", "neomme", "olmo_hybrid", "plamo2", "qwen3_5",
    "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "qwen4_exp", "qwen4_exp_text", "step3p7",
    "zamba", "zamba2"))
_NOT_UNIFORM_KEYS = ("per_layer_config", "layers_block_type", "attn_type_list", "hybrid_override_pattern",
                     "block_configs", "attn_layer_period", "attn_layer_indices", "full_attn_idxs", "mamba_d_state",
                     "ssm_state_size", "conv_L_cache")
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class KVShapeError(ValueError):
    """A checkpoint or setting from which no KV block size follows; the message says which and why."""


def check_block_tokens(block_tokens: int) -> int:
    """``block_tokens`` if vLLM's CPU backend takes it as ``--block-size``; :class:`KVShapeError` otherwise."""
    if block_tokens <= 0 or block_tokens % CPU_BLOCK_ALIGN:
        raise KVShapeError(f"block tokens must be a positive multiple of {CPU_BLOCK_ALIGN} (vLLM's CPU "
                           f"--block-size), not {block_tokens}")
    return block_tokens


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one token's KV is made of in a vLLM engine: layers, KV heads, head size, element type."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # the model dtype vLLM serves in (what to pass as --dtype)
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype

    def validate(self) -> "KVShape":
        for name in ("num_layers", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise KVShapeError(f"{name} must be positive, not {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise KVShapeError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.head_dim not in CPU_HEAD_SIZES:
            raise KVShapeError(f"head size {self.head_dim} is not supported by vLLM's CPU attention "
                               f"({', '.join(map(str, CPU_HEAD_SIZES))})")
        if self.kv_cache_dtype != "auto":
            if self.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
                raise KVShapeError(f"kv cache dtype {self.kv_cache_dtype!r} is not supported by vLLM's CPU "
                                   f"attention (auto, {', '.join(FP8_KV_CACHE_DTYPES)})")
            if self.head_dim % 32:
                raise KVShapeError(f"an fp8 KV cache needs a head size that is a multiple of 32 on CPU, "
                                   f"not {self.head_dim}")
        return self

    @property
    def element_bytes(self) -> int:
        return 1 if self.kv_cache_dtype in FP8_KV_CACHE_DTYPES else DTYPE_BYTES[self.dtype]

    def bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.element_bytes

    def block_bytes(self, block_tokens: int) -> int:
        """Bytes of one ``block_tokens``-token block across all layers: the data plane's slot size."""
        return self.bytes_per_token() * check_block_tokens(block_tokens)

    @classmethod
    def from_config(cls, config: dict[str, Any], *, dtype: str = "auto", kv_cache_dtype: str = "auto",
                    weights_dtype: str | None = None) -> "KVShape":
        """The shape vLLM gives a checkpoint with ``config`` (its config.json) served with ``--dtype dtype``.

        ``weights_dtype`` is the safetensors weights' dtype, used when the config names none.
        """
        if not isinstance(config, dict):
            raise KVShapeError("config.json does not hold a JSON object")
        model_type = str(config.get("model_type", ""))
        text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
        text_type = str(text.get("model_type", model_type))
        types = {model_type, text_type}
        _refuse_other_attention(text, types)
        text = {**{key: text[alias] for key, alias in _ALIASES.get(model_type, {}).items() if alias in text}, **text}
        if model_type == "bloom" and text.get("n_embed") is not None:
            text["hidden_size"] = text["n_embed"]  # BloomConfig: the older name wins
        layers = _positive_int(text, "num_hidden_layers")
        heads = _positive_int(text, "num_attention_heads") if "num_attention_heads" in text else None
        kv_heads = _kv_heads(model_type, text_type, text, heads)
        head_dim = _head_dim(text_type, text, heads)
        served = _served_dtype(model_type, _config_dtype(config) or weights_dtype or "float32", dtype)
        return cls(layers, kv_heads, head_dim, served, kv_cache_dtype).validate()

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, dtype: str = "auto", kv_cache_dtype: str = "auto") -> "KVShape":
        """The shape of the local checkpoint directory ``path`` (its config.json, else its weights' dtype)."""
        root = Path(path)
        if not root.is_dir():
            raise KVShapeError(f"{path} is not a directory (a local Hugging Face checkpoint is expected)")
        try:
            config = json.loads((root / "config.json").read_text())
        except OSError as exc:
            raise KVShapeError(f"cannot read {root / 'config.json'}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise KVShapeError(f"{root / 'config.json'} is not valid JSON: {exc}") from None
        named = not isinstance(config, dict) or _config_dtype(config) is not None
        weights = None if named or dtype.lower() != "auto" else _safetensors_dtype(root)
        return cls.from_config(config, dtype=dtype, kv_cache_dtype=kv_cache_dtype, weights_dtype=weights)


def _refuse_other_attention(text: dict[str, Any], types: set[str]) -> None:
    """:class:`KVShapeError` for a model whose KV block is not ``layers`` equal full-attention layers."""
    if text.get("kv_lora_rank") is not None:
        raise KVShapeError("multi-head latent attention (kv_lora_rank) is not derived here: give the block bytes "
                           "explicitly")
    listed = sorted(types & _NOT_UNIFORM_MODEL_TYPES)
    key = next((key for key in _NOT_UNIFORM_KEYS if text.get(key) is not None), None)
    other_layers = sorted({str(t) for t in text.get("layer_types") or ()} - set(_ATTENTION_LAYER_TYPES))
    why = (f"model type {listed[0]}" if listed else key or
           (f"layer types {', '.join(other_layers)}" if other_layers else None))
    if why:
        raise KVShapeError(f"hybrid, attention-free or per-layer attention ({why}) is not derived here: give the "
                           f"block bytes explicitly")


def _kv_heads(model_type: str, text_type: str, text: dict[str, Any], heads: int | None) -> int:
    """KV heads as vLLM counts them: the first KV-head key, else the attention heads, with the rules of the
    model types whose config classes decide otherwise."""
    if model_type == "falcon" and not text.get("new_decoder_architecture", False) and \
            bool(text.get("multi_query", True)):
        return 1  # Falcon's multi-query attention (multi_query: true in its config class)
    if model_type == "gpt_bigcode":
        return 1 if bool(text.get("multi_query", True)) else _positive_int(text, "num_attention_heads")
    if model_type == "dbrx":
        attn = text.get("attn_config") if isinstance(text.get("attn_config"), dict) else {}
        return _positive_int({"kv_n_heads": 1, **attn}, "kv_n_heads")  # DbrxAttentionConfig's default: 1
    if model_type == "chatglm":
        if not text.get("multi_query_attention", False):
            raise KVShapeError("ChatGLM without multi_query_attention: vLLM's config counts multi_query_group_num "
                               "KV heads, its model all attention heads; give the block bytes explicitly")
        return _positive_int({"multi_query_group_num": 1, **text}, "multi_query_group_num")
    kv_key = next((key for key in _KV_HEAD_KEYS if text.get(key) is not None), None)
    if kv_key:
        return _positive_int(text, kv_key)
    if heads is None:
        raise KVShapeError("config.json names neither num_key_value_heads nor num_attention_heads")
    if text_type not in _KV_HEADS_DEFAULT_TO_HEADS:
        raise KVShapeError(f"config.json names no num_key_value_heads and the {text_type or 'unnamed'} config class "
                           f"may default it otherwise: add it to config.json or give the block bytes explicitly")
    return heads


def _head_dim(text_type: str, text: dict[str, Any], heads: int | None) -> int:
    """``head_dim`` when positive, else ``hidden_size_per_head``, else ``hidden_size // num_attention_heads``."""
    if isinstance(text.get("head_dim"), int) and text["head_dim"] > 0:
        return text["head_dim"]
    if text.get("hidden_size_per_head") is not None:
        return _positive_int(text, "hidden_size_per_head")
    if heads is None:
        raise KVShapeError("config.json names no head_dim and no num_attention_heads to derive it")
    if "head_dim" not in text and text_type not in _HEAD_DIM_DEFAULTS_TO_DIVISION:
        raise KVShapeError(f"config.json names no head_dim and the {text_type or 'unnamed'} config class may default "
                           f"it otherwise: add it to config.json or give the block bytes explicitly")
    return _positive_int(text, "hidden_size") // heads


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KVShapeError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def _config_dtype(config: dict[str, Any]) -> str | None:
    """The dtype config.json names (``dtype`` or the older ``torch_dtype``; the text config's as a fallback)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (config, text):
        for key in ("dtype", "torch_dtype"):
            if source.get(key) is not None:
                named = str(source[key]).removeprefix("torch.")
                if named not in DTYPE_ALIASES:
                    raise KVShapeError(f"config.json: {key} {source[key]!r} is not one of {sorted(DTYPE_BYTES)}")
                return DTYPE_ALIASES[named]
    return None


def _safetensors_dtype(root: Path) -> str | None:
    """The weights' dtype from the safetensors headers: float32 if any tensor is, else the one half type."""
    found: set[str] = set()
    for file in sorted(root.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as exc:
            raise KVShapeError(f"cannot read the safetensors header of {file}: {exc}") from None
        found |= {_SAFETENSORS_DTYPES[t["dtype"]] for name, t in header.items()
                  if name != "__metadata__" and isinstance(t, dict) and t.get("dtype") in _SAFETENSORS_DTYPES}
    if "float32" in found or not found:
        return "float32" if found else None
    if len(found) > 1:
        raise KVShapeError(f"the weights mix {' and '.join(sorted(found))} and config.json names no dtype: "
                           f"give the dtype explicitly")
    return found.pop()


def _served_dtype(model_type: str, checkpoint: str, requested: str) -> str:
    """vLLM's model dtype on CPU for a checkpoint of dtype ``checkpoint`` under ``--dtype requested``."""
    requested = requested.lower()
    if requested != "auto":
        if requested not in DTYPE_ALIASES:
            raise KVShapeError(f"dtype {requested!r} is not one of auto, {', '.join(sorted(DTYPE_ALIASES))}")
        served = DTYPE_ALIASES[requested]
        if served == "float16" and model_type in _NO_FLOAT16:
            raise KVShapeError(f"vLLM refuses float16 for {model_type} models (use bfloat16 or float32)")
        return served
    if checkpoint == "float32" or (checkpoint == "float16" and model_type in _NO_FLOAT16):
        return "bfloat16"  # the CPU platform's first supported dtype
    return checkpoint
