"""A forced-output model for end-to-end server tests.

`ScriptedTarget` is a target adapter whose greedy continuation of any prompt is a given token
script (then end-of-sequence); `ScriptedDrafter` proposes that script, so every cycle accepts all
15 drafts and the server receives 16 tokens per commit. Real tokenizers and chat templates make the
output parsers, detokenizer and SSE path run as they do with real models.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx

from dflash_core.adapters import RollbackRecord, TargetOutput
from dflash_core.engine import Engine


@dataclass
class _Position:
    prompt_length: Optional[int] = None
    offset: int = 0

    def trim(self, n: int) -> int:
        self.offset -= n
        return n


class ScriptedTarget:
    family = "scripted"
    num_layers, hidden_size = 1, 4

    def __init__(self, vocab_size: int, eos: int):
        self.vocab_size, self.eos = vocab_size, eos
        self.script: list[int] = []
        self.dtype = mx.float32
        self.fail_after: Optional[int] = None  # forwards before an exception (failure tests)
        self.forwards = 0

    def make_cache(self, max_rollback: int):
        return [_Position()]

    def _token_at(self, index: int) -> int:
        return self.script[index] if 0 <= index < len(self.script) else self.eos

    def forward(self, tokens, cache, tap_ids=(), *, last_logits_only=False, record=False):
        self.forwards += 1
        if self.fail_after is not None and self.forwards > self.fail_after:
            raise RuntimeError("planted failure in the target")
        position = cache[0]
        n = tokens.shape[1]
        if position.prompt_length is None:
            position.prompt_length = n  # the first forward is the whole prompt
        rows = range(position.offset, position.offset + n)
        if last_logits_only:
            rows = rows[-1:]
        # Row at position p predicts the token at p + 1.
        choices = [self._token_at(p + 1 - position.prompt_length) for p in rows]
        logits = mx.zeros((len(choices), self.vocab_size))
        logits = logits.at[mx.arange(len(choices)), mx.array(choices)].add(30.0)[None]
        position.offset += n
        taps = mx.zeros((1, n, self.hidden_size * len(tap_ids))) if tap_ids else None
        return TargetOutput(logits, taps, RollbackRecord(n) if record else None)

    def forward_rows(self, rows, tap_ids=()):
        """The rows of a batched step, one after another (each row's script is its own)."""
        return [self.forward(r.tokens, r.cache, tap_ids, last_logits_only=r.last_logits_only, record=r.record)
                for r in rows]

    def rollback(self, cache, record, keep):
        cache[0].trim(record.tokens - keep)

    def rollback_rows(self, undos):
        for cache, record, keep in undos:
            self.rollback(cache, record, keep)


class ScriptedDrafter:
    block_size = 16

    def __init__(self, target: ScriptedTarget):
        self.target = target
        self.config = SimpleNamespace(target_layer_ids=[0], block_size=self.block_size)

    def make_cache(self):
        return [_Position()]

    def add_context(self, taps, cache):
        if cache[0].prompt_length is None:
            cache[0].prompt_length = taps.shape[1]
        cache[0].offset += taps.shape[1]

    def propose(self, bonus, target, cache, width=None):
        position = cache[0]
        first = position.offset + 1 - position.prompt_length  # script index after the bonus token
        return mx.array([self.target._token_at(first + j) for j in range((width or self.block_size) - 1)],
                        dtype=mx.int32)


def scripted_engine(tokenizer, speculative: bool = True) -> Engine:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(tokenizer.eos_token_ids)[0]
    target = ScriptedTarget(len(hf), eos)
    return Engine(target, tokenizer, ScriptedDrafter(target) if speculative else None, prefill_chunk=1 << 20)


@dataclass
class _RoutedPosition(_Position):
    script: Optional[list[int]] = None


class RoutedTarget(ScriptedTarget):
    """A scripted target whose script is chosen per generation from its prompt: `route(prompt
    tokens) -> script`. Target-alone only (the drafter would need the script too)."""

    def __init__(self, vocab_size: int, eos: int, route):
        super().__init__(vocab_size, eos)
        self.route = route

    def make_cache(self, max_rollback: int):
        return [_RoutedPosition()]

    def forward(self, tokens, cache, tap_ids=(), *, last_logits_only=False, record=False):
        position = cache[0]
        if position.script is None:
            position.script = self.route(tokens[0].tolist())
        self.script = position.script  # generations run one step at a time on the worker
        return super().forward(tokens, cache, tap_ids, last_logits_only=last_logits_only, record=record)


def routed_engine(tokenizer, route) -> Engine:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    target = RoutedTarget(len(hf), sorted(tokenizer.eos_token_ids)[0], route)
    return Engine(target, tokenizer, None, prefill_chunk=1 << 20)
