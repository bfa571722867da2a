"""Model shapes without weights: the released targets' text stacks, and tiny ones of every family.

`target_config` writes the config.json of a target of any supported family at a real shape or a
tiny one, and `random_model` builds mlx-lm's own class for it with seeded random weights. What
`dflash bench --random-weights` and the GPU benchmarks build from these is in `random_models.py`;
the tests write them to disk in the real Hugging Face layout (tests/synthetic.py).
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes

from .loading import cast_floating

FAMILIES = ("qwen3", "qwen3_5", "qwen3_5_moe", "gemma4", "gemma3_text")
TINY_VOCAB = 512  # the tests' tokenizer is trained to exactly this many ids


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


# Real shapes for GPU benchmarks (text stack only; values from the published configs, docs/formats.md).
REAL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(
        family="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0),
    "qwen3.5-9b": dict(
        family="qwen3_5", hidden_size=4096, num_hidden_layers=32, intermediate_size=12288,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, full_attention_interval=4, vocab_size=248320),
    "qwen3.5-27b": dict(
        family="qwen3_5", hidden_size=5120, num_hidden_layers=64, intermediate_size=17408,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, full_attention_interval=4, vocab_size=248320),
    "qwen3.6-35b-a3b": dict(
        family="qwen3_5_moe", hidden_size=2048, num_hidden_layers=40, intermediate_size=512,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, full_attention_interval=4, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        vocab_size=248320),
    "gemma-4-31b": dict(
        family="gemma4", hidden_size=5376, num_hidden_layers=60, intermediate_size=21504,
        num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
        head_dim=256, global_head_dim=512, attention_k_eq_v=True, sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size=262144,
        vocab_size_per_layer_input=262144, max_position_embeddings=262144),
    # The offline demo's target (its GGUF's metadata): small enough that a step is kernel launches.
    "gemma-3-270m": dict(
        family="gemma3_text", hidden_size=640, num_hidden_layers=18, intermediate_size=2048,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        vocab_size=262144, max_position_embeddings=32768, tie_word_embeddings=True),
}

# Token ids of the real vocabularies, used when a target has no tokenizer.
REAL_IDS = {
    "qwen3": dict(eos=151645, bos=151643, pad=151643, mask=151669),
    "qwen3_5": dict(eos=248046, bos=248044, pad=248044, mask=248070),
    "gemma4": dict(eos=[1, 106], bos=2, pad=0, mask=4),
}
REAL_IDS["qwen3_5_moe"] = REAL_IDS["qwen3_5"]
REAL_IDS["gemma3_text"] = REAL_IDS["gemma4"]


def tiny_text(family: str) -> dict[str, Any]:
    """Text-config fields of the tiny shapes (0.8-1.0 MB of fp32 weights each)."""
    base = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=TINY_VOCAB, max_position_embeddings=4096)
    if family == "qwen3":
        return {**base, "rope_theta": 1000000.0}
    if family in ("qwen3_5", "qwen3_5_moe"):
        # Interval 2 gives linear, full, linear, full: both kinds twice.
        base.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    full_attention_interval=2)
        if family == "qwen3_5_moe":
            base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16)
        return base
    if family == "gemma3_text":  # global layers 2 and 5, window 8
        return {**base, "num_hidden_layers": 6, "intermediate_size": 64, "sliding_window": 8, "sliding_window_pattern": 3,
                "query_pre_attn_scalar": 16, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0}
    # Gemma 4: a union of the E2B features (per-layer inputs, KV sharing) and
    # the 31B ones (k == v on full layers, wider global heads), window 8.
    return {**base, "num_hidden_layers": 5, "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                            "sliding_attention", "full_attention"],
            "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 4,
            "vocab_size_per_layer_input": TINY_VOCAB, "global_head_dim": 32,
            "num_global_key_value_heads": 1, "attention_k_eq_v": True,
            "use_double_wide_mlp": False}


def merge(base: dict, over: dict | None) -> dict:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def target_config(family: str, shape: str | dict = "tiny", *, ids: dict | None = None,
                  config_overrides: dict | None = None) -> dict[str, Any]:
    """The config.json of a target.

    `shape`: "tiny", a REAL_SHAPES name, or a dict of text-config fields laid
    over {"base": "tiny" or a REAL_SHAPES name} (derived fields such as
    layer_types follow it). `config_overrides` is deep-merged last, verbatim
    (tests use it to plant inconsistent configs). `ids` = {eos, bos, pad}.
    """
    check_family(family)
    over = dict(shape) if isinstance(shape, dict) else {}
    base = over.pop("base", "tiny") if isinstance(shape, dict) else shape
    if base == "tiny":
        text = tiny_text(family)
    elif base in REAL_SHAPES:
        text = copy.deepcopy(REAL_SHAPES[base])
        if text.pop("family") != family:
            raise ValueError(f"shape {base!r} is not a {family} model")
    else:
        raise ValueError(f"unknown shape {base!r}; known: tiny, {', '.join(REAL_SHAPES)}")
    text = merge(text, over)
    if len(text.get("layer_types", [])) not in (0, text["num_hidden_layers"]):
        raise ValueError("layer_types must have num_hidden_layers entries; pass them in shape")
    ids = ids or REAL_IDS[family]
    tokens = {"eos_token_id": ids["eos"], "bos_token_id": ids["bos"], "pad_token_id": ids["pad"]}
    text.setdefault("rms_norm_eps", 1e-6)

    if family == "qwen3":
        config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                  "tie_word_embeddings": False, "hidden_act": "silu", **text, **tokens}
    elif family in ("qwen3_5", "qwen3_5_moe"):
        n, every = text["num_hidden_layers"], text["full_attention_interval"]
        text.update(
            model_type=f"{family}_text", tie_word_embeddings=False, attention_bias=False,
            attn_output_gate=True, hidden_act="silu",
            layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention"
                         for i in range(n)],
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                             "partial_rotary_factor": 0.25},
            **tokens)
        arch = "Qwen3_5MoeForConditionalGeneration" if family == "qwen3_5_moe" \
            else "Qwen3_5ForConditionalGeneration"
        config = {"architectures": [arch], "model_type": family, "text_config": text,
                  "tie_word_embeddings": False, **tokens}
    elif family == "gemma3_text":
        config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                  "hidden_activation": "gelu_pytorch_tanh", **text, **tokens}
    else:
        text.update(
            model_type="gemma4_text", tie_word_embeddings=True, final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            **tokens)
        # mlx-lm's gemma4 ModelArgs overwrites text_config.vocab_size with the
        # TOP-LEVEL vocab_size (default 262144), so it must be set here too.
        config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                  "text_config": text, "vocab_size": text["vocab_size"],
                  "tie_word_embeddings": True, **tokens}
    return merge(config, config_overrides)


def random_model(config: dict, *, seed: int = 0, dtype: str = "float32") -> nn.Module:
    """Instantiate mlx-lm's own class for `config` with seeded random weights.

    Arrays stay lazy until saved/evaluated, so real shapes never hold a
    float32 copy of the whole model.
    """
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    # from_dict / __post_init__ mutate nested dicts (rope_parameters, text_config).
    model = model_cls(args_cls.from_dict(copy.deepcopy(config)))
    cast_floating(model, getattr(mx, dtype))  # qwen3.5 keeps A_log fp32
    model.eval()
    return model
