"""The synthetic checkpoints look like the real ones and load through mlx-lm."""

import json

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes, load_model, load_tokenizer
from synthetic import build_drafter, build_target, drafter_tensor_shapes, train_tokenizer

from dflash_core.drafter_config import default_target_layer_ids
from dflash_core.loading import parameter_bytes
from dflash_core.shapes import FAMILIES, REAL_SHAPES, TINY_VOCAB, random_model, target_config

MARKERS = {
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
             "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|mask|>"],
    "gemma4": ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>",
               "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
               "<tool_response|>", '<|"|>', "<|tool>", "<tool|>", "<mask>"],
    "gemma3_text": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<mask>"],
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer"}}}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
TEXT = 'Hello café naïve Ångström 東京 你好 🚀🤖 def f(x):\n    return {"a": [1, 2.5]}'


@pytest.fixture(params=FAMILIES)
def family_pair(request):
    return request.param, request.getfixturevalue(f"{request.param}_pair")


def _config(path):
    return json.loads((path / "config.json").read_text())


def _markers(family):
    return MARKERS[family if family.startswith("gemma") else "qwen"]


# --------------------------------------------------------------------- target

def test_target_loads_strict_and_logits_roundtrip(family_pair):
    family, (target, _) = family_pair
    model, _ = load_model(target, strict=True)
    config = _config(target)
    text = config.get("text_config", config)
    assert config["model_type"] == family and "eos_token_id" in config
    assert text["vocab_size"] == TINY_VOCAB == len(load_tokenizer(target)._tokenizer)
    assert parameter_bytes(model) < 1_000_000

    fresh = random_model(config, seed=0)  # same seed, never saved
    tokens = mx.array([[5, 77, 300, 12, 9, 501, 42, 42, 7, 100, 256, 3, 8, 19, 64, 1, 2, 400]])
    logits = model(tokens)
    assert logits.shape == (1, tokens.shape[1], TINY_VOCAB)
    assert mx.array_equal(logits, fresh(tokens)).item()
    assert mx.all(mx.isfinite(logits)).item()


def test_target_architecture_features(qwen3_5_pair, qwen3_5_moe_pair, gemma4_pair, qwen3_pair):
    assert _config(qwen3_pair[0])["architectures"] == ["Qwen3ForCausalLM"]
    assert _config(qwen3_pair[0])["tie_word_embeddings"] is False
    for target, arch in [(qwen3_5_pair[0], "Qwen3_5ForConditionalGeneration"),
                         (qwen3_5_moe_pair[0], "Qwen3_5MoeForConditionalGeneration")]:
        config = _config(target)
        assert config["architectures"] == [arch]
        assert config["text_config"]["model_type"] == config["model_type"] + "_text"
        kinds = {layer.is_linear for layer in load_model(target)[0].layers}
        assert kinds == {True, False}  # GatedDeltaNet and full attention
    moe = load_model(qwen3_5_moe_pair[0])[0]
    assert all(hasattr(layer.mlp, "switch_mlp") for layer in moe.layers)

    config = _config(gemma4_pair[0])
    text = config["text_config"]
    assert (config["model_type"], text["model_type"]) == ("gemma4", "gemma4_text")
    assert set(text["layer_types"]) == {"sliding_attention", "full_attention"}
    assert text["sliding_window"] == 8 and text["num_kv_shared_layers"] > 0
    assert text["hidden_size_per_layer_input"] > 0
    assert text["global_head_dim"] != text["head_dim"]
    assert text["final_logit_softcapping"] == 30.0


def test_gemma4_runs_past_the_sliding_window(gemma4_pair):
    model, _ = load_model(gemma4_pair[0])
    tokens = mx.array([list(range(10, 30))])  # 20 > window 8
    full = model(tokens)
    cache = model.make_cache()
    steps = [model(tokens[:, :6], cache=cache)]
    steps += [model(tokens[:, i:i + 1], cache=cache) for i in range(6, 20)]
    assert mx.allclose(full, mx.concatenate(steps, axis=1), atol=1e-4).item()


def test_bf16_target_keeps_a_log_in_float32(tmp_path):
    target = build_target(tmp_path, "qwen3_5", dtype="bfloat16", seed=3, tokenizer=False)
    model, config = load_model(target)
    dtypes = {k: v.dtype for k, v in (mx.load(str(target / "model.safetensors"))).items()}
    assert all(d == (mx.float32 if k.endswith("A_log") else mx.bfloat16) for k, d in dtypes.items())
    tokens = mx.array([[1, 2, 3, 4]])
    fresh = random_model(config, seed=3, dtype="bfloat16")
    assert mx.array_equal(model(tokens), fresh(tokens)).item()


def test_shape_dict_and_config_overrides(tmp_path):
    target = build_target(tmp_path, "qwen3", shape={"num_hidden_layers": 5}, tokenizer=False,
                          config_overrides={"rope_theta": 5000.0})
    config = _config(target)
    assert config["num_hidden_layers"] == 5 and config["rope_theta"] == 5000.0
    assert len(load_model(target)[0].layers) == 5
    with pytest.raises(ValueError):
        build_target(tmp_path / "x", "llama")


def test_real_shapes_make_valid_configs():
    for name, shape in REAL_SHAPES.items():
        config = target_config(shape["family"], name)
        _, args_cls = _get_classes(config)
        args = args_cls.from_dict(json.loads(json.dumps(config)))
        text = config.get("text_config", config)
        assert text["vocab_size"] > 150_000 and "eos_token_id" in config, name
        assert args.model_type == shape["family"]
    assert target_config("gemma4", "gemma-4-31b")["vocab_size"] == 262144
    with pytest.raises(ValueError):
        target_config("qwen3", "gemma-4-31b")


def test_every_family_has_a_tiny_random_pair_for_the_benchmarks():
    """`tiny-<family>` (dflash bench --random-weights, the GPU scripts' --tiny checks) for every
    family: a random target and a random drafter of its example's layout that generate, with
    speculation, exactly what the target alone does."""
    from dflash_core.engine import Engine
    from dflash_core.random_models import FAMILY_EXAMPLES, ByteTokenizer, parse_shape, random_drafter, random_target

    assert set(FAMILY_EXAMPLES) == set(FAMILIES)
    for family in FAMILIES:
        name, tiny = parse_shape(f"tiny-{family}")
        target = random_target(name, tiny=tiny)
        engine = Engine(target, ByteTokenizer(target.vocab_size), random_drafter(name, target, tiny))
        prompt = list(range(20, 60))

        def tokens(mode):
            return [t for c in engine.generate(prompt, max_tokens=12, speculation=mode, stop_token_ids=set())
                    for t in c.token_ids]

        assert tokens("on") == tokens("off"), family


# ------------------------------------------------------------------ tokenizer

def test_tokenizer_roundtrips_multibyte_text(family_pair):
    family, (target, _) = family_pair
    tok = load_tokenizer(target)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    # At least one character's UTF-8 bytes straddle a token boundary.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = tok.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == TEXT
    for marker in _markers(family):
        assert tok.encode(marker, add_special_tokens=False) == [tok.convert_tokens_to_ids(marker)]
    eos = _config(target)["eos_token_id"]
    assert tok.eos_token_id == (eos[-1] if isinstance(eos, list) else eos)
    if family.startswith("gemma"):
        assert tok.encode("hi")[0] == tok.bos_token_id == _config(target)["bos_token_id"]


def test_tokenizer_training_is_deterministic(tmp_path):
    a = train_tokenizer(tmp_path / "a", "qwen3_5")
    b = train_tokenizer(tmp_path / "b", "qwen3_5")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


# -------------------------------------------------------------- chat template

def _conversation():
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "OLD-THOUGHT"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "NEW-THOUGHT",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
    ]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_5_moe"])
def test_qwen_chat_template(family, request):
    target, _ = request.getfixturevalue(f"{family}_pair")
    tok = load_tokenizer(target)
    assert "<tool_call>\n<function=" in tok.chat_template
    assert tok.tool_call_start == "<tool_call>" and tok.think_start == "<think>"
    render = lambda msgs, **kw: tok.apply_chat_template(  # noqa: E731
        msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kw)
    out = render(_conversation())
    assert out.startswith("<|im_start|>system\n") and "<tools>\n{" in out and "</tools>" in out
    assert "You are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" in out
    assert "<|im_start|>assistant\nHello.<|im_end|>" in out and "OLD-THOUGHT" not in out
    assert "<|im_start|>assistant\n<think>\nNEW-THOUGHT\n</think>\n\n<tool_call>" in out
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n")
    assert call in out
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in out
    assert out.endswith("<|im_start|>assistant\n<think>\n")
    assert render(_conversation(), enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # mlx-lm's own parser reads our tool call back.
    body = out.split("<tool_call>")[-1].split("</tool_call>")[0]
    assert tok.tool_parser(body, TOOLS) == {"name": "get_weather",
                                            "arguments": {"city": "Paris", "days": 3}}
    plain = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                    add_generation_prompt=True, enable_thinking=True)
    assert plain == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_gemma4_chat_template(gemma4_pair):
    tok = load_tokenizer(gemma4_pair[0])
    assert tok.tool_call_start == "<|tool_call>" and tok.think_start == "<|channel>thought"
    out = tok.apply_chat_template(_conversation(), tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True, enable_thinking=True)
    assert out.startswith("<bos><|turn>system\n<|think|>\nYou are terse.<|tool>declaration:get_weather{")
    assert "<tool|><turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello.<turn|>\n" in out
    assert "OLD-THOUGHT" not in out
    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
    assert f"<|turn>model\n<|channel>thought\nNEW-THOUGHT\n<channel|>{call}" in out
    # The tool response continues the open model turn: no generation prompt.
    assert out.endswith('<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>')
    assert tok.tool_parser(call[len("<|tool_call>"):-len("<tool_call|>")]) == {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}

    plain = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False) == "<bos><|turn>user\nx<turn|>\n<|turn>model\n"
    answered = _conversation() + [{"role": "assistant", "content": "Sunny."},
                                  {"role": "user", "content": "Thanks"}]
    out = tok.apply_chat_template(answered, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert "<tool_response|>Sunny.<turn|>\n<|turn>user\nThanks<turn|>\n<|turn>model\n" in out
    assert "<|think|>" not in out


# -------------------------------------------------------------------- drafter

def _drafter_shape_args(config):
    taps = (config.get("dflash_config") or {}).get("target_layer_ids") or config["target_layer_ids"]
    return (config["hidden_size"], len(taps), config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["intermediate_size"])


def test_drafter_has_zlab_names_shapes_and_config(family_pair):
    family, (target, drafter) = family_pair
    config, target_cfg = _config(drafter), _config(target)
    text = target_cfg.get("text_config", target_cfg)
    weights = mx.load(str(drafter / "model.safetensors"))
    expected = drafter_tensor_shapes(*_drafter_shape_args(config))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert "layers.1.self_attn.q_norm.weight" in weights and "embed_tokens.weight" not in weights
    taps = config["dflash_config"]["target_layer_ids"]
    assert weights["fc.weight"].shape == (text["hidden_size"], len(taps) * text["hidden_size"])
    assert mx.array_equal(weights["norm.weight"], mx.ones((text["hidden_size"],))).item()
    assert float(mx.abs(weights["fc.weight"]).max()) < 0.2

    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["hidden_size"] == text["hidden_size"]
    assert config["vocab_size"] == text["vocab_size"]
    assert config["num_target_layers"] == text["num_hidden_layers"]
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == 2
    assert config["layer_types"] == ["full_attention"] * 2
    dflash = config["dflash_config"]
    assert dflash["block_size"] == 16
    assert len(taps) >= 2 and all(0 <= t < text["num_hidden_layers"] for t in taps)
    mask = "<mask>" if family.startswith("gemma") else "<|mask|>"
    assert dflash["mask_token_id"] == load_tokenizer(target).convert_tokens_to_ids(mask)
    assert config["rope_parameters"]["rope_type"] == "default"
    assert "block_size" not in config and "rope_theta" not in config
    assert ("final_logit_softcapping" in config) == (family == "gemma4")


def test_drafter_old_layout_and_variants(qwen3_pair, gemma4_pair, tmp_path):
    old = build_drafter(tmp_path / "old", qwen3_pair[0], layout="old", num_layers=3,
                        target_layer_ids=[0, 3], block_size=8)
    config = _config(old)
    assert config["block_size"] == 8 and config["rope_theta"] > 0 and config["rope_scaling"] is None
    assert config["dflash_config"] == {"target_layer_ids": [0, 3],
                                       "mask_token_id": config["dflash_config"]["mask_token_id"]}
    assert "rope_parameters" not in config
    assert mx.load(str(old / "model.safetensors"))["fc.weight"].shape == (64, 128)

    variant = build_drafter(
        tmp_path / "v", gemma4_pair[0], weight_prefix="model.", dtype="bfloat16",
        layer_types=["sliding_attention", "full_attention"], sliding_window=4, mask_token_id=7,
        extra_config={"architectures": ["DFlash2DraftModel"], "dflash_config": {"causal": True}},
        extra_tensors={"lm_head.weight": (TINY_VOCAB, 64)}, omit_tensors=("norm.weight",))
    config = _config(variant)
    weights = mx.load(str(variant / "model.safetensors"))
    assert all(k.startswith("model.") for k in weights)
    assert "model.lm_head.weight" in weights and "model.norm.weight" not in weights
    assert all(v.dtype == mx.bfloat16 for v in weights.values())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["causal"] is True and config["dflash_config"]["mask_token_id"] == 7
    assert config["sliding_window"] == 4 and config["layer_types"][0] == "sliding_attention"
    assert config["final_logit_softcapping"] == 30.0


def test_drafter_is_deterministic(qwen3_pair, tmp_path):
    a = build_drafter(tmp_path / "a", qwen3_pair[0], seed=5)
    b = build_drafter(tmp_path / "b", qwen3_pair[0], seed=5)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_tiny_pair_factory(tiny_pair_factory):
    target, drafter = tiny_pair_factory("qwen3", num_layers=1, target_layer_ids=[1, 2, 3])
    assert _config(drafter)["num_hidden_layers"] == 1
    assert mx.load(str(drafter / "model.safetensors"))["fc.weight"].shape == (64, 192)
    assert (target / "tokenizer.json").exists()
    target, drafter = tiny_pair_factory("gemma4", target_kwargs={"shape": {"hidden_size": 96}})
    assert _config(drafter)["hidden_size"] == _config(target)["text_config"]["hidden_size"] == 96


def test_default_target_layer_ids_match_released_drafters():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(32) == [1, 8, 15, 22, 29]  # Qwen3.5-9B
    assert default_target_layer_ids(64) == [1, 16, 31, 46, 61]  # Qwen3.5-27B
    assert default_target_layer_ids(40) == [1, 10, 19, 28, 37]  # Qwen3.5-35B-A3B
    assert default_target_layer_ids(60, 6) == [1, 12, 23, 35, 46, 57]  # gemma-4-31B
    for n in (4, 5, 6):
        ids = default_target_layer_ids(n)
        assert len(ids) >= 2 and ids == sorted(set(ids)) and ids[-1] < n


def test_the_demo_shape_is_the_shipped_demo_drafters_layout():
    """The benchmarks' random `gemma-3-270m` drafter stands in for the shipped one: its layout
    follows the drafter in the package (a new shipped drafter updates both)."""
    from dflash_core.demo import DEMO_DRAFTER
    from dflash_core.random_models import RELEASED_DRAFTERS

    shipped = json.loads((DEMO_DRAFTER / "config.json").read_text())
    shape = RELEASED_DRAFTERS["gemma-3-270m"]
    assert (shape["layers"], shape["heads"], shape["kv"], shape["inter"], shape["taps"], shape["mask"]) == (
        shipped["num_hidden_layers"], shipped["num_attention_heads"], shipped["num_key_value_heads"],
        shipped["intermediate_size"], shipped["dflash_config"]["target_layer_ids"],
        shipped["dflash_config"]["mask_token_id"])


def test_forced_acceptance_forces_a_batch_as_it_forces_each_row():
    """The benchmarks' forced target (`random_models.ForcedAcceptance`) makes a batch's choices
    in a few ops for all rows: each row gets exactly what it gets forced alone (choices and
    boosted logits, the schedule's cycles taken in row order), and generations stepping together
    accept the schedule's drafts, cycle after cycle."""
    from dflash_core.adapters import ForwardRow
    from dflash_core.batching import step_together
    from dflash_core.engine import Engine
    from dflash_core.random_models import ByteTokenizer, ForcedAcceptance, parse_shape, random_drafter, random_target

    name, tiny = parse_shape("tiny-qwen3_5")
    target = random_target(name, tiny=tiny)
    schedule = [0, 15, 3, 7, 1]
    prompts = [list(range(20 + r, 50 + 3 * r)) for r in range(3)]
    blocks = [mx.array([[5 + r + j for j in range(w)]]) for r, w in enumerate([16, 4, 16])]

    def rows():
        caches = []
        for p in prompts:
            cache = target.make_cache(16)
            target.forward(mx.array([p]), cache)
            caches.append(cache)
        return [ForwardRow(b, c, record=True) for b, c in zip(blocks, caches)]

    together = ForcedAcceptance(target, schedule).forward_rows(rows())
    one_by_one = ForcedAcceptance(target, schedule)
    alone = [one_by_one.forward_rows([row])[0] for row in rows()]
    for r, (a, b) in enumerate(zip(together, alone)):
        # The schedule's drafts, the next one bumped (rejected), the rest, then token 0.
        drafts, accept = blocks[r][0, 1:].tolist(), min(schedule[r], blocks[r].shape[1] - 1)
        expected = (drafts[:accept] + [(d + 1) % target.vocab_size for d in drafts[accept:accept + 1]]
                    + drafts[accept + 1:] + [0])
        assert a.choices.tolist() == b.choices.tolist() == expected
        assert a.logits.argmax(-1)[0].tolist() == expected

    drafter = random_drafter(name, target, tiny)
    engine = Engine(ForcedAcceptance(target, [4]), ByteTokenizer(target.vocab_size), drafter)
    streams = [engine.generate(p, max_tokens=41, stop_token_ids=set(), batched=True, speculation="on") for p in prompts]
    stats = [None] * len(streams)
    live = list(range(len(streams)))
    while live:
        for i, r in zip(list(live), step_together(engine, [streams[i] for i in live])):
            if r.chunk is not None and r.chunk.stats is not None:
                stats[i] = r.chunk.stats
            if r.done or (r.chunk is not None and r.chunk.finish_reason):
                live.remove(i)
    assert all(s.generated_tokens == 41 and s.cycles == 8 for s in stats)  # the first token, then 8 x (4 + 1)
