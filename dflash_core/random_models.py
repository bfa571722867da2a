"""Random-weight targets and drafters built in memory at the released shapes (speed only).

The tests write random checkpoints to disk for the loading code (tests/synthetic.py); this module
builds them straight into adapters for speed measurements (`dflash bench --random-weights`,
`benchmarks/gpu_cycle.py`, `benchmarks/gpu_profile.py`), so nothing is downloaded or written.
Random drafters accept almost nothing, so these pairs measure speed, never acceptance;
`ForcedAcceptance` makes the target agree with a fixed number of drafts per cycle instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .adapters import TargetAdapter, adapter_for
from .adapters.base import join
from .drafter import DFlashDrafter
from .drafter_config import DrafterConfig, default_target_layer_ids
from .loading import quantizable
from .rows import part
from .shapes import REAL_SHAPES, random_model, target_config

# Released drafters' shapes (docs/formats.md): layers, heads, kv heads, intermediate, taps, mask,
# layer types (sliding window) of the z-lab checkpoint for each target.
RELEASED_DRAFTERS: dict[str, dict] = {
    "qwen3-8b": dict(layers=5, heads=32, kv=8, inter=12288, taps=[1, 9, 17, 25, 33], mask=151669),
    "qwen3.5-9b": dict(layers=5, heads=32, kv=8, inter=12288, taps=[1, 8, 15, 22, 29], mask=248070),
    "qwen3.5-27b": dict(layers=5, heads=32, kv=8, inter=17408, taps=[1, 16, 31, 46, 61], mask=248070),
    "qwen3.6-35b-a3b": dict(layers=6, heads=32, kv=8, inter=6144, taps=[1, 6, 11, 16, 22, 27, 32, 37], mask=248077,
                            sliding=(5, 4096)),
    "gemma-4-31b": dict(layers=5, heads=64, kv=8, inter=10752, taps=[1, 12, 23, 35, 46, 57], mask=4,
                        sliding=(4, 2048), softcap=30.0),
    # No released drafter: the shipped demo drafter's layout (dflash_core/demo/gemma-3-270m-dflash).
    "gemma-3-270m": dict(layers=5, heads=4, kv=1, inter=1536, taps=[1, 4, 8, 12, 15], mask=4),
}

# `tiny-<family>` builds the tiny shapes of the family, with the drafter layout of this model.
FAMILY_EXAMPLES = {"qwen3": "qwen3-8b", "qwen3_5": "qwen3.5-9b", "qwen3_5_moe": "qwen3.6-35b-a3b",
                   "gemma4": "gemma-4-31b", "gemma3_text": "gemma-3-270m"}
QUANTS = ("bf16", "4bit")


def parse_shape(spec: str) -> tuple[str, bool]:
    """`--random-weights` value -> (REAL_SHAPES name, tiny). `tiny-<family>` is the tiny shape."""
    if spec in REAL_SHAPES:
        return spec, False
    if spec.startswith("tiny-") and spec[5:] in FAMILY_EXAMPLES:
        return FAMILY_EXAMPLES[spec[5:]], True
    known = ", ".join(list(REAL_SHAPES) + [f"tiny-{f}" for f in FAMILY_EXAMPLES])
    raise ValueError(f"unknown random-weights shape {spec!r}; known: {known}")


def random_target(name: str, quant: str = "bf16", layers: Optional[int] = None, tiny: bool = False) -> TargetAdapter:
    """A random target at REAL_SHAPES[name] (bf16, or 4-bit quantized), or its family's tiny shape
    in float32 (tiny=True: checks scripts on a CPU, measures nothing)."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, not {quant!r}")
    family = REAL_SHAPES[name]["family"]
    shape = {"base": "tiny" if tiny else name}
    if layers:  # fewer layers for a quick look; the full model is the default
        shape["num_hidden_layers"] = layers
        if "layer_types" in REAL_SHAPES[name] and not tiny:
            shape["layer_types"] = REAL_SHAPES[name]["layer_types"][:layers]
    model = random_model(target_config(family, shape), dtype="float32" if tiny else "bfloat16")
    if quant == "4bit":
        nn.quantize(model, group_size=64, bits=4, class_predicate=quantizable(model, 64))
    mx.eval(model.parameters())
    return adapter_for(model)


def random_drafter(name: str, target: TargetAdapter, tiny: bool = False) -> DFlashDrafter:
    """A random drafter with the released z-lab drafter's shape for target `name` (and the
    target's kernel options)."""
    d = RELEASED_DRAFTERS[name]
    if tiny:
        d = {**d, "layers": 2, "heads": 4, "kv": 2, "inter": 128, "taps": [1, 2], "mask": 3,
             "sliding": (1, 8) if "sliding" in d else (0, None)}
    n_sliding, window = d.get("sliding", (0, None))
    taps = [t for t in d["taps"] if t < target.num_layers] or default_target_layer_ids(target.num_layers, 3)
    raw = {
        "architectures": ["DFlashDraftModel"], "hidden_size": target.hidden_size, "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv"], "head_dim": 16 if tiny else 128,
        "intermediate_size": d["inter"], "vocab_size": target.vocab_size, "rope_theta": 10000000.0,
        "layer_types": ["sliding_attention"] * n_sliding + ["full_attention"] * (d["layers"] - n_sliding),
        "sliding_window": window,
        "dflash_config": {"block_size": 16, "target_layer_ids": taps, "mask_token_id": d["mask"],
                          "final_logit_softcapping": d.get("softcap")},
    }
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw), target.kernels)
    drafter.set_dtype(target.dtype)
    mx.eval(drafter.parameters())
    drafter.stack_shared_inputs()
    return drafter


class ForcedAcceptance:
    """A target whose choice at each verify row is overridden so that exactly `schedule[cycle]`
    drafts are accepted. Everything else (forward, taps, rollback) is the real adapter.

    Only verify forwards (the ones that record what a rollback needs) are touched: prefill chunks and
    target-alone decode steps pass through unchanged, whatever their length. A verify narrower than
    the block (speculation auto) accepts at most its drafts."""

    def __init__(self, target: TargetAdapter, schedule: Sequence[int], block: int = 16):
        self.target, self.schedule, self.block, self.cycle = target, list(schedule), block, 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, tokens, cache, tap_ids=(), *, last_logits_only=False, record=False):
        out = self.target.forward(tokens, cache, tap_ids, last_logits_only=last_logits_only, record=record)
        return self._force([tokens], [out])[0] if record and tokens.shape[1] >= 2 else out

    def forward_rows(self, rows, tap_ids=()):
        """The batched forward, each row's verify forced as `forward` forces it."""
        outs = self.target.forward_rows(rows, tap_ids)
        forced = [i for i, r in enumerate(rows) if r.record and r.tokens.shape[1] >= 2]
        if forced:
            for i, out in zip(forced, self._force([rows[i].tokens for i in forced], [outs[i] for i in forced])):
                outs[i] = out
        return outs

    def _force(self, blocks: Sequence[mx.array], outs: list) -> list:
        """Verify outputs with their choices forced, for verify blocks [1, w] of the rows. The
        choices of all the rows are made by a few ops for the batch, as a real greedy batch takes
        its one argmax (`adapters.base.batch_choices`): made row by row they cost 17 graph ops per
        row, host time a real batch does not spend, which grew the measured round with its rows."""
        widths = [b.shape[1] for b in blocks]
        wanted = self._wanted(join(blocks)[0], widths)
        boost = self._boost(wanted, outs[0].logits.dtype)
        forced, at = [], 0
        for out, w in zip(outs, widths):
            forced.append(replace(out, logits=out.logits + part(boost, at, at + w, axis=0)[None],
                                  choices=None if out.choices is None else part(wanted, at, at + w, axis=0)))
            at += w
        return forced

    def _wanted(self, tokens: mx.array, widths: Sequence[int]) -> mx.array:
        """The forced choices of verify blocks laid end to end (`tokens`, int32 [sum widths]): in
        each block the next `accept` drafts, then the draft after them plus one (rejected), then
        the rest; the last position (after the last draft) chooses token 0."""
        take, bump, keep, start = [], [], [], 0
        for width in widths:
            accept = min(self.schedule[self.cycle % len(self.schedule)], width - 1)
            self.cycle += 1
            for j in range(width):
                take.append(start + 1 + j if j < width - 1 else start)
                bump.append(1 if j == accept else 0)
                keep.append(1 if j < width - 1 else 0)
            start += width
        picked = tokens[mx.array(take)] + mx.array(bump, dtype=tokens.dtype)
        return (picked % self.vocab_size) * mx.array(keep, dtype=tokens.dtype)

    def _boost(self, wanted: mx.array, dtype) -> mx.array:
        # The forced choices are `wanted` by construction (a boost of 1e4 over random logits).
        return (mx.arange(self.vocab_size)[None] == wanted[:, None]).astype(dtype) * 1e4


class ByteTokenizer:
    """Stands in for the tokenizer a random target does not have: UTF-8 bytes mapped into the
    vocabulary, no end-of-sequence token (a random model runs to max_tokens), no text out."""

    bos_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int, offset: int = 16):
        self.vocab_size, self.offset = vocab_size, offset
        self.eos_token_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [(b + self.offset) % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, tokens, **kwargs) -> str:
        return ""
