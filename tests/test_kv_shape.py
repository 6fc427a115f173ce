"""kvmesh_apps.kv_shape: one KV block's bytes from a checkpoint's config.json, under vLLM 0.32's CPU rules.

The arithmetic is checked on hand-computed configs; the rules (served dtype, head size, KV heads) against vLLM's
own ModelConfig and FullAttentionSpec on the same config.json files (no engine started). The end-to-end oracle,
the connector's size check in a real engine, is tests/engine_connector/test_vllm_other_shape.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kvmesh_apps.kv_shape import KVShape, KVShapeError, check_block_tokens

LLAMA3_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
             "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16"}


def _config(**overrides) -> dict:
    return {k: v for k, v in {**LLAMA3_8B, **overrides}.items() if v is not None}


def _checkpoint(tmp_path: Path, config: dict | str, name: str = "model") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def _safetensors(path: Path, dtypes: list[str]) -> None:
    """A header-only-sized safetensors file whose tensors have ``dtypes`` (2 elements each)."""
    width = {"F32": 4, "BF16": 2, "F16": 2}
    header, offset = {}, 0
    for i, dtype in enumerate(dtypes):
        header[f"w{i}"] = {"dtype": dtype, "shape": [2], "data_offsets": [offset, offset + 2 * width[dtype]]}
        offset += 2 * width[dtype]
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_gqa_llama_bf16_is_128_kib_per_token() -> None:
    shape = KVShape.from_config(_config())
    assert (shape.num_layers, shape.kv_heads, shape.head_dim, shape.dtype) == (32, 8, 128, "bfloat16")
    assert shape.bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    assert shape.block_bytes(32) == 4 * 1024 * 1024 and shape.block_bytes(64) == 8 * 1024 * 1024


def test_explicit_head_dim_wins_over_hidden_over_heads() -> None:
    # Qwen3-style: hidden 2048 / 16 heads would be 128; the config says 64.
    shape = KVShape.from_config(_config(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                                        head_dim=64, num_hidden_layers=28))
    assert (shape.kv_heads, shape.head_dim) == (4, 64)
    assert shape.bytes_per_token() == 2 * 28 * 4 * 64 * 2


def test_kv_heads_default_to_the_attention_heads() -> None:
    shape = KVShape.from_config(_config(num_key_value_heads=None, hidden_size=1024, num_attention_heads=16))
    assert (shape.kv_heads, shape.head_dim) == (16, 64)


def test_gpt2_style_names_and_falcons_multi_query_attention() -> None:
    gpt2 = KVShape.from_config({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768})
    assert (gpt2.num_layers, gpt2.kv_heads, gpt2.head_dim, gpt2.dtype) == (12, 12, 64, "bfloat16")
    usual = KVShape.from_config({"model_type": "gpt2", "num_hidden_layers": 2, "n_layer": 12, "n_head": 12,
                                 "n_embd": 768})
    assert usual.num_layers == 2  # the usual key wins over another name
    # the other names are read for the model types whose config classes map them, nowhere else: DBRX's (its KV
    # heads in attn_config, vLLM's count), not Mamba2's num_heads (SSM heads: an attention-free model, refused)
    dbrx = KVShape.from_config({"model_type": "dbrx", "n_layers": 40, "n_heads": 48, "d_model": 6144,
                                "attn_config": {"kv_n_heads": 8}})
    assert (dbrx.num_layers, dbrx.kv_heads, dbrx.head_dim) == (40, 8, 128)
    with pytest.raises(KVShapeError, match="attention-free"):
        KVShape.from_config({"model_type": "mamba2", "num_heads": 128, "head_dim": 64, "hidden_size": 4096,
                             "num_hidden_layers": 64})
    with pytest.raises(KVShapeError, match="num_hidden_layers"):
        KVShape.from_config({"model_type": "llama", "n_layer": 12, "n_head": 12, "n_embd": 768})
    falcon = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32}
    assert KVShape.from_config(falcon).kv_heads == 1  # Falcon-7B's shape; multi_query is Falcon's default
    assert KVShape.from_config({**falcon, "multi_query": False}).kv_heads == 71
    assert KVShape.from_config({**falcon, "new_decoder_architecture": True, "num_kv_heads": 8}).kv_heads == 8
    assert KVShape.from_config({**falcon, "model_type": "llama"}).kv_heads == 71  # the rule is Falcon's alone


def test_float32_checkpoint_is_served_in_bfloat16_on_cpu_unless_asked() -> None:
    fp32 = _config(torch_dtype="float32")
    assert KVShape.from_config(fp32).dtype == "bfloat16"
    served = KVShape.from_config(fp32).bytes_per_token()
    assert KVShape.from_config(fp32, dtype="float32").bytes_per_token() == 2 * served
    assert KVShape.from_config(fp32, dtype="float").dtype == "float32"


def test_float16_checkpoint_stays_float16_except_where_vllm_refuses_it() -> None:
    assert KVShape.from_config(_config(torch_dtype="float16")).dtype == "float16"
    assert KVShape.from_config(_config(torch_dtype="float16"), dtype="half").dtype == "float16"
    gemma = _config(model_type="gemma2", torch_dtype="float16", head_dim=128)
    assert KVShape.from_config(gemma).dtype == "bfloat16"
    with pytest.raises(KVShapeError, match="float16 for gemma2"):
        KVShape.from_config(gemma, dtype="float16")


def test_dtype_key_text_config_and_torch_prefix() -> None:
    assert KVShape.from_config(_config(torch_dtype=None, dtype="torch.float16")).dtype == "float16"
    nested = {"model_type": "llava", "text_config": _config(torch_dtype=None, num_hidden_layers=4),
              "torch_dtype": "bfloat16"}
    shape = KVShape.from_config(nested)
    assert (shape.num_layers, shape.dtype) == (4, "bfloat16")


def test_fp8_kv_cache_is_one_byte_per_element() -> None:
    shape = KVShape.from_config(_config(), kv_cache_dtype="fp8")
    assert shape.bytes_per_token() == 2 * 32 * 8 * 128
    with pytest.raises(KVShapeError, match="multiple of 32"):
        KVShape.from_config(_config(hidden_size=2560, num_attention_heads=32), kv_cache_dtype="fp8_e4m3")  # 80
    with pytest.raises(KVShapeError, match="not supported by vLLM's CPU"):
        KVShape.from_config(_config(), kv_cache_dtype="int8_per_token_head")


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_size": 3072, "num_attention_heads": 64}, "head size 48"),
    ({"num_hidden_layers": None}, "num_hidden_layers must be a positive integer"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers must be a positive integer"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    ({"torch_dtype": "int8"}, "torch_dtype 'int8'"),
    ({"kv_lora_rank": 512}, "latent attention"),
])
def test_bad_configs_are_refused_with_the_reason(overrides: dict, message: str) -> None:
    with pytest.raises(KVShapeError, match=message):
        KVShape.from_config(_config(**overrides))


def test_block_tokens_must_be_a_positive_multiple_of_32() -> None:
    assert check_block_tokens(64) == 64
    for bad in (0, -32, 16, 48):
        with pytest.raises(KVShapeError, match="multiple of 32"):
            check_block_tokens(bad)
    with pytest.raises(KVShapeError):
        KVShape.from_config(_config()).block_bytes(16)


def test_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(KVShapeError, match="not a directory"):
        KVShape.from_checkpoint(tmp_path / "missing")
    (tmp_path / "no-config").mkdir()
    with pytest.raises(KVShapeError, match="cannot read .*config.json"):
        KVShape.from_checkpoint(tmp_path / "no-config")
    with pytest.raises(KVShapeError, match="not valid JSON"):
        KVShape.from_checkpoint(_checkpoint(tmp_path, "{not json", "broken"))
    with pytest.raises(KVShapeError, match="JSON object"):
        KVShape.from_checkpoint(_checkpoint(tmp_path, "[1, 2]", "list"))


def test_weights_dtype_when_the_config_names_none(tmp_path: Path) -> None:
    bf16 = _checkpoint(tmp_path, _config(torch_dtype=None), "bf16")
    _safetensors(bf16, ["BF16", "BF16"])
    assert KVShape.from_checkpoint(bf16, dtype="auto").dtype == "bfloat16"
    fp16 = _checkpoint(tmp_path, _config(torch_dtype=None), "fp16")
    _safetensors(fp16, ["F16"])
    assert KVShape.from_checkpoint(fp16).dtype == "float16"
    mixed = _checkpoint(tmp_path, _config(torch_dtype=None), "mixed")
    _safetensors(mixed, ["F16", "F32"])
    assert KVShape.from_checkpoint(mixed).dtype == "bfloat16"  # float32 weights: bfloat16 on CPU
    halves = _checkpoint(tmp_path, _config(torch_dtype=None), "halves")
    _safetensors(halves, ["F16", "BF16"])
    with pytest.raises(KVShapeError, match="mix bfloat16 and float16"):
        KVShape.from_checkpoint(halves)
    assert KVShape.from_checkpoint(halves, dtype="float16").dtype == "float16"  # explicit: weights not read
    none = _checkpoint(tmp_path, _config(torch_dtype=None), "none")
    assert KVShape.from_checkpoint(none).dtype == "bfloat16"  # no dtype anywhere: float32 -> bfloat16


# ---- the same config.json files through vLLM's own ModelConfig and FullAttentionSpec ----

VLLM_CASES = {
    "llama-gqa-bf16": _config(),
    "llama-fp32-auto": _config(torch_dtype="float32", num_hidden_layers=3),
    "llama-fp16": _config(torch_dtype="float16", num_hidden_layers=2),
    "qwen3-head-dim": _config(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=2048,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_hidden_layers=4),
    "mha-no-kv-heads": _config(num_key_value_heads=None, hidden_size=1024, num_attention_heads=16,
                               torch_dtype="float32"),
    "no-dtype": _config(torch_dtype=None, num_hidden_layers=2),
    # configs that name their geometry otherwise (Hugging Face's attribute maps)
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 3, "n_head": 12, "n_embd": 768,
             "vocab_size": 50257, "n_positions": 1024, "torch_dtype": "float32"},
    "falcon-multi-query": {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 1024,
                           "num_attention_heads": 16, "num_hidden_layers": 2, "multi_query": True,
                           "new_decoder_architecture": False, "vocab_size": 1000, "torch_dtype": "bfloat16"},
    "falcon-new-decoder": {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 1024,
                           "num_attention_heads": 16, "num_kv_heads": 4, "num_hidden_layers": 2,
                           "multi_query": True, "new_decoder_architecture": True, "vocab_size": 1000,
                           "torch_dtype": "bfloat16"},
    "gpt-neox": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 512,
                 "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 1000, "torch_dtype": "float16"},
    "gptj": {"model_type": "gptj", "architectures": ["GPTJForCausalLM"], "n_embd": 1024, "n_head": 16, "n_layer": 2,
             "rotary_dim": 32, "vocab_size": 1000, "torch_dtype": "float16"},
    "bloom": {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": 1024, "n_head": 16,
              "n_layer": 2, "vocab_size": 1000, "torch_dtype": "bfloat16"},
    # families derived as their config classes and vLLM count them (each refused or miscounted before)
    "bloom-n-embed": {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "n_embed": 2048, "n_head": 16,
                      "n_layer": 2, "vocab_size": 1000, "torch_dtype": "bfloat16"},
    "gpt-sw3": {"model_type": "gpt-sw3", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_head": 16,
                "n_embd": 2048, "vocab_size": 1000, "n_positions": 2048, "torch_dtype": "float16"},
    "starcoder-multi-query": {"model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"], "n_layer": 2,
                              "n_head": 48, "n_embd": 6144, "multi_query": True, "n_positions": 8192,
                              "vocab_size": 1000, "torch_dtype": "bfloat16"},
    "gpt-bigcode-multi-head": {"model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"], "n_layer": 2,
                               "n_head": 16, "n_embd": 1024, "multi_query": False, "vocab_size": 1000,
                               "torch_dtype": "bfloat16"},
    "dbrx": {"model_type": "dbrx", "architectures": ["DbrxForCausalLM"], "n_layers": 2, "n_heads": 48, "d_model": 6144,
             "attn_config": {"kv_n_heads": 8}, "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16,
                                                              "moe_top_k": 4}, "vocab_size": 1000,
             "max_seq_len": 4096, "torch_dtype": "bfloat16"},
    "glm-4-chatglm": {"model_type": "chatglm", "architectures": ["ChatGLMModel"], "num_layers": 2, "hidden_size": 4096,
                      "num_attention_heads": 32, "multi_query_attention": True, "multi_query_group_num": 2,
                      "kv_channels": 128, "ffn_hidden_size": 13696, "padded_vocab_size": 1000, "seq_length": 8192,
                      "torch_dtype": "bfloat16"},
}


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["auto", "float32", "float16"])
def test_the_derivation_agrees_with_vllms_model_config(tmp_path: Path, dtype: str) -> None:
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    for name, config in VLLM_CASES.items():
        path = _checkpoint(tmp_path, {"max_position_embeddings": 4096, **config}, name)
        vllm = ModelConfig(model=str(path), dtype=dtype, skip_tokenizer_init=True)
        ours = KVShape.from_checkpoint(path, dtype=dtype)
        assert ours.dtype == str(vllm.dtype).removeprefix("torch."), name
        assert (ours.num_layers, ours.kv_heads, ours.head_dim) == (
            vllm.get_num_layers(ParallelConfig()), vllm.get_total_num_kv_heads(), vllm.get_head_size()), name
        for block_tokens in (32, 64):
            spec = FullAttentionSpec(block_size=block_tokens, num_kv_heads=vllm.get_total_num_kv_heads(),
                                     head_size=vllm.get_head_size(),
                                     dtype=kv_cache_dtype_str_to_dtype("auto", vllm))
            assert ours.block_bytes(block_tokens) == spec.page_size_bytes * ours.num_layers, name


@pytest.mark.parametrize("config, message", [
    (_config(model_type="qwen3", hidden_size=1024, num_attention_heads=16), "no head_dim and the qwen3 config"),
    (_config(model_type="mistral", num_key_value_heads=None), "no num_key_value_heads and the mistral config"),
    ({**_config(model_type="jamba"), "attn_layer_period": 8}, "hybrid"),
    ({**_config(), "layer_types": ["full_attention", "linear_attention"]}, "layer types linear_attention"),
    (_config(model_type="gemma4_text", head_dim=256), "per-layer"),
    ({**_config(model_type="chatglm", num_layers=2), "multi_query_attention": False}, "ChatGLM"),
])
def test_what_vllm_counts_from_elsewhere_is_refused(config: dict, message: str) -> None:
    with pytest.raises(KVShapeError, match=message):
        KVShape.from_config(config)


_KV_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")


def _without_head_dim(text: dict) -> None:
    """Drops head_dim and doubles the width: hidden_size // heads then differs from any class default."""
    text.pop("head_dim", None)
    for key in ("hidden_size", "n_embd", "d_model"):
        if isinstance(text.get(key), int):
            text[key] *= 2


def _without_kv_heads(text: dict) -> None:
    """Drops the KV-head keys and doubles the heads (and width): the heads then differ from any class default."""
    for key in _KV_KEYS:
        text.pop(key, None)
    for key in ("num_attention_heads", "n_head", "n_heads", "hidden_size", "n_embd", "d_model"):
        if isinstance(text.get(key), int):
            text[key] *= 2


@pytest.mark.vllm
@pytest.mark.parametrize("variant", [None, _without_head_dim, _without_kv_heads])
def test_transformers_default_configs_agree_with_vllm_or_are_refused(tmp_path: Path, variant) -> None:
    """Every model type vLLM serves as a generator with a transformers config class: its class defaults as
    config.json, through vLLM's own config loading, geometry convertor and dtype rule (what ModelConfig calls,
    without inspecting the model class); kv_shape must give the same shape or refuse."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto
    from vllm.config.model import _get_and_verify_dtype
    from vllm.model_executor.models import ModelRegistry
    from vllm.transformers_utils.config import get_config, get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (MODEL_ARCH_CONFIG_CONVERTORS,
                                                                     ModelArchConfigConvertorBase)

    supported = {arch.lower(): arch for arch in ModelRegistry.get_supported_archs()}  # PhiMoE, not Phimoe
    generators = (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                  modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    compared, unloadable = [], []
    for model_type in dict.fromkeys(CONFIG_MAPPING.keys()):  # vLLM registers some types a second time
        named = [names.get(model_type) for names in generators]
        named = [arch for found in named for arch in ([found] if isinstance(found, str) else found or ())]
        archs = [supported[arch.lower()] for arch in named if arch.lower() in supported]
        if not archs:
            continue
        config = {**CONFIG_MAPPING[model_type]().to_dict(), "model_type": model_type, "architectures": archs[:1]}
        if variant:
            variant(config["text_config"] if isinstance(config.get("text_config"), dict) else config)
        path = _checkpoint(tmp_path, json.dumps(config, default=str), model_type)
        try:
            hf = get_config(str(path), False)
            arch = MODEL_ARCH_CONFIG_CONVERTORS.get(hf.model_type, ModelArchConfigConvertorBase)(
                hf, get_hf_text_config(hf)).convert()
            dtype = str(_get_and_verify_dtype(str(path), hf, "auto", is_pooling_model=False)).removeprefix("torch.")
        except Exception:  # vLLM cannot load this default config itself
            unloadable.append(model_type)
            continue
        try:
            ours = KVShape.from_checkpoint(path)
        except KVShapeError:
            continue  # refused, with the reason
        assert (ours.num_layers, ours.kv_heads, ours.head_dim, ours.dtype) == (
            arch.total_num_hidden_layers, arch.total_num_kv_heads, arch.head_size, dtype), model_type
        compared.append(model_type)
    assert len(compared) >= 30 and len(unloadable) <= 10, (compared, unloadable)
