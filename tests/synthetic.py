"""Random-weight targets and DFlash drafters saved in real Hugging Face layouts.

Tests (tiny shapes, float32) and GPU benchmarks (real shapes, bf16) load these
through the product's real loading code, so the files must look exactly like
the published ones: mlx-community style targets (config.json +
model.safetensors written by mlx-lm's own save helpers) and z-lab style
drafters (config.json + safetensors with un-prefixed tensor names).
Nothing here downloads anything.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import save_config, save_model

from dflash_core.drafter_config import default_target_layer_ids
from dflash_core.shapes import REAL_IDS, TINY_VOCAB, check_family, merge, random_model, target_config

# ----------------------------------------------------------------- tokenizers

# (token, special flag). Real Qwen3 marks the think/tool tags non-special so
# decode(skip_special_tokens=True) keeps them; we copy that.
_QWEN_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<think>", False), ("</think>", False), ("<tool_call>", False),
    ("</tool_call>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<|mask|>", True),
]
# Gemma's first ids are fixed in the real vocab (pad 0, eos 1, bos 2, unk 3,
# mask 4: the z-lab gemma drafters use mask id 4), so they lead the vocab.
_GEMMA_HEAD = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
_GEMMA3_ADDED = ["<start_of_turn>", "<end_of_turn>"]
_GEMMA_ADDED = [
    "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool_call>",
    "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|tool>",
    "<tool|>",
]
# Qwen2/3 pre-tokenizer split: single digits, letters runs, punctuation runs.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = (
    "the a model token draft target verify accept block layer cache window "
    "server request stream tool call function parameter response system user "
    "assistant thought think channel turn weather city temperature report value "
    "quick brown fox jumps over lazy dog while river mountain light paper music "
    "speculative decoding is lossless when every proposal matches the argmax"
).split()
_ACCENTED = "café naïve façade über señor crème brûlée Ångström Straße déjà vu São Paulo Zürich".split()
_CJK = "日本語 東京 中文 你好世界 한국어 漢字 学习 机器 模型 推理 速度 测试".split()
_EMOJI = ["😀", "🚀", "🎉", "👍", "🔥", "✨", "🌍", "🤖", "💡", "🧪"]


def _corpus(seed: int = 1234, lines: int = 1200) -> list[str]:
    """Deterministic mixed text: prose, code, numbers, JSON, multi-byte UTF-8."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        kind = i % 6
        if kind == 0:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
            out.append(" ".join(words).capitalize() + ".")
        elif kind == 1:
            name, arg = rng.choice(_WORDS), rng.choice(_WORDS)
            out.append(
                f"def {name}_{i}({arg}, n={rng.randint(0, 99)}):\n"
                f"    if {arg} is None:\n        return []\n"
                f"    return [{arg} * k for k in range(n)]  # {rng.choice(_WORDS)}\n"
            )
        elif kind == 2:
            out.append(
                f"{rng.randint(0, 10**6)} {rng.uniform(-1e3, 1e3):.3f} "
                f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 255):#04x}"
            )
        elif kind == 3:
            obj = {rng.choice(_WORDS): rng.choice([rng.randint(0, 100), rng.choice(_WORDS),
                                                  [1, 2, 3], True, None])
                   for _ in range(3)}
            out.append(json.dumps({"name": rng.choice(_WORDS), "arguments": obj}))
        elif kind == 4:
            out.append(" ".join(rng.choice(_ACCENTED) for _ in range(5)))
        else:
            out.append(" ".join(rng.choice(_CJK + _EMOJI) for _ in range(4)))
    return out


def train_tokenizer(out_dir, family: str, *, vocab_size: int = TINY_VOCAB) -> Path:
    """Train a byte-level BPE and write tokenizer.json + tokenizer_config.json.

    The vocabulary (including added tokens) has exactly `vocab_size` ids.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    check_family(family)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gemma = family.startswith("gemma")
    tail = [(t, True) for t in (_GEMMA_ADDED if family == "gemma4" else _GEMMA3_ADDED)] if gemma else _QWEN_ADDED
    head = _GEMMA_HEAD if gemma else []

    tok = Tokenizer(models.BPE())
    if gemma:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(tail), special_tokens=head, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in tail])
    if gemma:  # like HF Gemma tokenizers: encode() prepends <bos>
        bos = tok.token_to_id("<bos>")
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"BPE produced {tok.get_vocab_size()} ids, wanted {vocab_size}")
    tok.save(str(out / "tokenizer.json"))

    names = ({"bos_token": "<bos>", "eos_token": "<turn|>" if family == "gemma4" else "<end_of_turn>", "pad_token": "<pad>",
              "unk_token": "<unk>", "mask_token": "<mask>"} if gemma else
             {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    decoder = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                         "rstrip": False, "single_word": False, "special": s}
               for t, s in [(h, True) for h in head] + tail}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "add_bos_token": gemma,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
        "chat_template": {"gemma4": GEMMA4_CHAT_TEMPLATE, "gemma3_text": GEMMA3_CHAT_TEMPLATE}.get(family, QWEN_CHAT_TEMPLATE),
        **names,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(names, indent=2))
    return out


# Qwen3.5-style ChatML. The generation prompt opens a think block; with
# enable_thinking=false it is pre-closed. Past reasoning survives only on
# assistant turns after the last real user query (as Qwen3 does).
QWEN_CHAT_TEMPLATE = """\
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools %}
  {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
  {%- for tool in tools %}
    {{- '\n' + (tool | tojson) }}
  {%- endfor %}
  {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>' }}
  {%- if messages[0].role == 'system' %}
    {{- '\n\n' + messages[0].content }}
  {%- endif %}
  {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
  {%- set content = message.content if message.content is string else '' %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
    {%- if '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
      {%- set content = content.split('</think>')[-1] %}
    {%- endif %}
    {{- '<|im_start|>assistant\n' }}
    {%- if loop.index0 > ns.last_query %}
      {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
    {%- endif %}
    {{- content.strip('\n') }}
    {%- for call in message.tool_calls or [] %}
      {%- set fn = call.function if call.function is defined else call %}
      {%- if loop.first and content.strip('\n') %}
        {{- '\n\n' }}
      {%- elif not loop.first %}
        {{- '\n' }}
      {%- endif %}
      {{- '<tool_call>\n<function=' + fn.name + '>\n' }}
      {%- if fn.arguments is mapping %}
        {%- for name, value in fn.arguments.items() %}
          {{- '<parameter=' + name + '>\n' }}
          {%- if value is mapping or (value is iterable and value is not string) %}
            {{- value | tojson }}
          {%- else %}
            {{- value | string }}
          {%- endif %}
          {{- '\n</parameter>\n' }}
        {%- endfor %}
      {%- elif fn.arguments is string %}
        {{- fn.arguments + '\n' }}
      {%- endif %}
      {{- '</function>\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
      {{- '<|im_start|>user' }}
    {%- endif %}
    {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
      {{- '<|im_end|>\n' }}
    {%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' }}
  {%- if enable_thinking is defined and not enable_thinking %}
    {{- '<think>\n\n</think>\n\n' }}
  {%- else %}
    {{- '<think>\n' }}
  {%- endif %}
{%- endif %}
"""

# Gemma 4 style. Thinking is off unless enable_thinking (as in the real
# template); tool calls and their responses share one model turn, so after a
# tool response the turn stays open and no generation prompt is added.
# Gemma 3 turns: <start_of_turn>role ... <end_of_turn>; the system prompt joins the first user turn.
GEMMA3_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- set first = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' -%}
{%- for m in messages if m['role'] != 'system' -%}
  {{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' -}}
  {{- (first if loop.first else '') + m['content'] | trim -}}
  {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

GEMMA4_CHAT_TEMPLATE = """\
{%- macro gval(v) -%}
  {%- if v is string -%}<|"|>{{ v }}<|"|>
  {%- elif v is boolean -%}{{ 'true' if v else 'false' }}
  {%- elif v is none -%}null
  {%- elif v is mapping -%}{ {%- for k, x in v | dictsort -%}{{ k }}:{{ gval(x) }}{{ ',' if not loop.last }}{%- endfor -%} }
  {%- elif v is iterable -%}[ {%- for x in v -%}{{ gval(x) }}{{ ',' if not loop.last }}{%- endfor -%} ]
  {%- else -%}{{ v }}
  {%- endif -%}
{%- endmacro -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- set ns = namespace(open=false, last_user=-1) -%}
{%- set loop_messages = messages -%}
{{- bos_token -}}
{%- if thinking or tools or (messages and messages[0].role == 'system') -%}
  {{- '<|turn>system\n' -}}
  {%- if thinking -%}{{- '<|think|>\n' -}}{%- endif -%}
  {%- if messages and messages[0].role == 'system' -%}
    {{- messages[0].content | trim -}}
    {%- set loop_messages = messages[1:] -%}
  {%- endif -%}
  {%- for tool in tools or [] -%}
    {%- set fn = tool.function if tool.function is defined else tool -%}
    {{- '<|tool>declaration:' + fn.name + '{description:' + gval(fn.description or '') -}}
    {%- if fn.parameters -%}{{- ',parameters:' + gval(fn.parameters) -}}{%- endif -%}
    {{- '}<tool|>' -}}
  {%- endfor -%}
  {{- '<turn|>\n' -}}
{%- endif -%}
{%- for m in loop_messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in loop_messages -%}
  {%- if m.role != 'tool' -%}
    {%- set role = 'model' if m.role == 'assistant' else m.role -%}
    {%- if not (ns.open and role == 'model') -%}
      {%- if ns.open -%}{{- '<turn|>\n' -}}{%- endif -%}
      {{- '<|turn>' + role + '\n' -}}
    {%- endif -%}
    {%- set ns.open = false -%}
    {%- if m.reasoning_content and loop.index0 > ns.last_user -%}
      {{- '<|channel>thought\n' + m.reasoning_content + '\n<channel|>' -}}
    {%- endif -%}
    {%- for call in m.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {{- '<|tool_call>call:' + fn.name + '{' -}}
      {%- if fn.arguments is mapping -%}
        {%- for k, x in fn.arguments | dictsort -%}{{ k }}:{{ gval(x) }}{{ ',' if not loop.last }}{%- endfor -%}
      {%- else -%}{{- fn.arguments -}}
      {%- endif -%}
      {{- '}<tool_call|>' -}}
    {%- endfor -%}
    {%- if m.content is string -%}{{- m.content | trim -}}{%- endif -%}
    {%- if m.tool_calls and not (m.content is string and m.content | trim) -%}
      {%- set ns.open = true -%}
    {%- else -%}
      {{- '<turn|>\n' -}}
    {%- endif -%}
  {%- else -%}
    {%- set name = m.name or 'unknown' -%}
    {{- '<|tool_response>response:' + name + '{value:' + gval(m.content) + '}<tool_response|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.open -%}
  {{- '<|turn>model\n' -}}
{%- endif -%}
"""


def build_target(out_dir, family: str, *, shape: str | dict = "tiny", dtype: str = "float32",
                 seed: int = 0, config_overrides: dict | None = None,
                 tokenizer: bool = True) -> Path:
    """Write a random target as mlx-community does: config.json, model.safetensors,
    generation_config.json and (tokenizer=True) the trained tokenizer files."""
    check_family(family)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = None
    if tokenizer:
        vocab = json.loads((train_tokenizer(out, family) / "tokenizer.json").read_text())
        table = {t["content"]: t["id"] for t in vocab["added_tokens"]}
        ids = (dict(eos=[table["<eos>"], table["<turn|>" if family == "gemma4" else "<end_of_turn>"]],
                    bos=table["<bos>"], pad=table["<pad>"])
               if family.startswith("gemma") else
               dict(eos=table["<|im_end|>"], bos=table["<|endoftext|>"], pad=table["<|endoftext|>"]))
    elif shape == "tiny" or (isinstance(shape, dict) and shape.get("base", "tiny") == "tiny"):
        ids = dict(eos=0, bos=0, pad=0)  # no vocabulary to take them from
    config = target_config(family, shape, ids=ids, config_overrides=config_overrides)
    config["dtype"] = dtype
    model = random_model(config, seed=seed, dtype=dtype)
    save_model(out, model, donate_model=True)
    save_config(copy.deepcopy(config), out / "config.json")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


# ------------------------------------------------------------------- drafters

# Drafter (heads, kv heads, head_dim, intermediate) of the released z-lab
# drafters, keyed by the target hidden size (docs/formats.md).
_DRAFTER_DIMS = {4096: (32, 8, 128, 12288), 5120: (32, 8, 128, 17408),
                 2048: (32, 4, 128, 6144), 5376: (64, 8, 128, 10752)}


def _read_target(target_dir: Path) -> tuple[str, dict, dict]:
    config = json.loads((target_dir / "config.json").read_text())
    family = config["model_type"]
    check_family(family)
    return family, config, config.get("text_config", config)


def _mask_id(target_dir: Path, family: str) -> int:
    path = target_dir / "tokenizer.json"
    if not path.exists():
        return REAL_IDS[family]["mask"]
    name = "<mask>" if family.startswith("gemma") else "<|mask|>"
    return next(t["id"] for t in json.loads(path.read_text())["added_tokens"]
                if t["content"] == name)


def build_drafter(out_dir, target_dir, *, num_layers: int = 2,
                  target_layer_ids: list[int] | None = None, layout: str = "new",
                  layer_types: list[str] | None = None, sliding_window: int | None = None,
                  block_size: int = 16, mask_token_id: int | None = None, seed: int = 0,
                  dtype: str = "float32", extra_config: dict | None = None,
                  weight_prefix: str = "", num_attention_heads: int | None = None,
                  num_key_value_heads: int | None = None, head_dim: int | None = None,
                  intermediate_size: int | None = None, rope_theta: float | None = None,
                  extra_tensors: dict[str, tuple[int, ...]] | None = None,
                  omit_tensors: tuple[str, ...] = ()) -> Path:
    """Write a random DFlash drafter in the z-lab checkpoint format.

    `extra_tensors` (name -> shape) and `omit_tensors` (names, without the
    prefix) plant stray or missing weights for loader tests.
    """
    if layout not in ("new", "old"):
        raise ValueError(f"layout must be 'new' or 'old', not {layout!r}")
    target_dir, out = Path(target_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    family, top, text = _read_target(target_dir)
    H, n_target = text["hidden_size"], text["num_hidden_layers"]
    heads, kv, hd, inter = _DRAFTER_DIMS.get(H, (4, 2, 16, 2 * H) if H < 1024
                                             else (H // 128, 8, 128, 3 * H))
    heads, kv = num_attention_heads or heads, num_key_value_heads or kv
    hd, inter = head_dim or hd, intermediate_size or inter
    taps = list(target_layer_ids) if target_layer_ids is not None \
        else default_target_layer_ids(n_target, 6 if family == "gemma4" and n_target >= 12 else None)
    mask = _mask_id(target_dir, family) if mask_token_id is None else mask_token_id
    types = list(layer_types or ["full_attention"] * num_layers)
    theta = rope_theta or (1000000.0 if family in ("qwen3", "gemma4", "gemma3_text") else 10000000.0)

    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": H, "num_hidden_layers": num_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": inter,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
        "attention_dropout": 0.0, "vocab_size": text["vocab_size"],
        "max_position_embeddings": text.get("max_position_embeddings", 262144),
        "tie_word_embeddings": False, "num_target_layers": n_target,
        "layer_types": types, "sliding_window": sliding_window,
        "use_sliding_window": "sliding_attention" in types, "dtype": dtype,
    }
    if family == "gemma4":
        config["final_logit_softcapping"] = text.get("final_logit_softcapping", 30.0)
    if layout == "new":
        config["dflash_config"] = {"block_size": block_size, "target_layer_ids": taps,
                                   "mask_token_id": mask}
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        config.update(block_size=block_size, rope_theta=theta, rope_scaling=None,
                      dflash_config={"target_layer_ids": taps, "mask_token_id": mask})
    config = merge(config, extra_config)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

    shapes = drafter_tensor_shapes(H, len(taps), num_layers, heads, kv, hd, inter)
    shapes.update(extra_tensors or {})
    mx.random.seed(seed)
    target = getattr(mx, dtype)
    weights = {}
    for name in sorted(shapes):  # sorted: the same seed gives the same tensors
        if name in omit_tensors:
            continue
        shape = shapes[name]
        w = mx.ones(shape) if name.endswith("norm.weight") else 0.02 * mx.random.normal(shape)
        weights[weight_prefix + name] = w.astype(target)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    return out


def drafter_tensor_shapes(hidden: int, num_taps: int, num_layers: int, heads: int,
                          kv_heads: int, head_dim: int, intermediate: int
                          ) -> dict[str, tuple[int, ...]]:
    """The exact z-lab tensor names and shapes (docs/formats.md)."""
    shapes = {"fc.weight": (hidden, num_taps * hidden), "hidden_norm.weight": (hidden,),
              "norm.weight": (hidden,)}
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        })
    return shapes


def tiny_pair(root, family: str, *, target_kwargs: dict | None = None,
              **drafter_kwargs) -> tuple[Path, Path]:
    """build_target + build_drafter under root/"target" and root/"drafter".

    `target_kwargs` go to build_target, e.g. {"shape": {"hidden_size": 96}}.
    """
    root = Path(root)
    target = build_target(root / "target", family, **(target_kwargs or {}))
    return target, build_drafter(root / "drafter", target, **drafter_kwargs)
