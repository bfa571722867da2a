"""One sampler for target-alone and speculative decoding.

`Sampler.choose` turns a block of target logits into the target's own choice at each row. Row i of a
verify block sees the history the target would have seen had the drafts before it been accepted
(penalties count them), and its randomness depends only on (seed, index of the generated token),
never on how tokens were grouped into forwards. Accepting a draft token exactly when it equals the
target's own choice (point-mass rejection sampling) therefore reproduces target-alone decoding token
for token for a given seed, at any temperature, and samples the target's distribution exactly.

Order of logit processing (as vLLM): the grammar's mask, logit_bias, repetition penalty (prompt +
output), presence and frequency penalties (output), temperature, top-k, top-p, min-p; then Gumbel-max
sampling, which draws exactly from softmax of the processed logits. The mask comes first, so top-k,
top-p and min-p pick among the tokens the grammar allows.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np


class SamplingError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> "SamplingParams":
        checks = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be between 0 and 100"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables it)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingError(param, f"{message}, got {getattr(self, param)}")
        for token, bias in (self.logit_bias or {}).items():
            if not 0 <= int(token) < vocab_size:
                raise SamplingError("logit_bias", f"token id {token} is outside the vocabulary (0..{vocab_size - 1})")
            if not -100.0 <= float(bias) <= 100.0:
                raise SamplingError("logit_bias", f"bias for token {token} must be between -100 and 100, got {bias}")
        return self


_MASK32 = 0xFFFFFFFF


def _mix32(x: mx.array) -> mx.array:
    """murmur3's 32-bit finalizer: a bijection with full avalanche (uint32 arithmetic wraps)."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x85EBCA6B, dtype=mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(0xC2B2AE35, dtype=mx.uint32)
    return x ^ (x >> 16)


class Sampler:
    def __init__(self, params: SamplingParams, vocab_size: int, prompt_tokens: Sequence[int] = ()):
        self.params = params
        self.vocab_size = vocab_size
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._seed_lo = mx.array(seed & _MASK32, dtype=mx.uint32)
        self._seed_hi = mx.array((seed >> 32) & _MASK32, dtype=mx.uint32)
        self._token_hash: Optional[mx.array] = None
        self._bias = None
        if params.logit_bias:
            ids = mx.array([int(t) for t in params.logit_bias], dtype=mx.int32)
            values = mx.array([float(b) for b in params.logit_bias.values()], dtype=mx.float32)
            self._bias = mx.zeros((vocab_size,), mx.float32).at[ids].add(values)
            # The same bias as (ids, values) of its entries, for a batch's one argmax (batch_bias).
            self._bias_entries = self._entries(params.logit_bias)
        self._seen = None  # prompt + output tokens, for the repetition penalty
        if params.repetition_penalty != 1.0:
            self._seen = mx.zeros((vocab_size,), mx.float32)
            if prompt_tokens:
                self._seen = self._seen.at[mx.array(list(prompt_tokens), dtype=mx.int32)].add(1.0)
        self._counts = None  # output tokens, for presence and frequency penalties
        if params.presence_penalty or params.frequency_penalty:
            self._counts = mx.zeros((vocab_size,), mx.float32)

    def _entries(self, logit_bias: dict) -> tuple[list[int], list[float]]:
        """The dense bias's entries as (sorted ids, float32 values). Where every id is given once
        each is its value rounded to float32, which is what the dense add left there (0 + v), so it
        is found on the host; reading them back from the device would wait for every forward
        queued before this generation started (other rows of a batch included). An id given under
        two spellings ("5", "05") is read back, so that its sum is the dense add's own."""
        ids = [int(t) for t in logit_bias]
        if len(set(ids)) == len(ids):
            order = sorted(range(len(ids)), key=ids.__getitem__)
            values = list(logit_bias.values())
            return [ids[i] for i in order], [float(np.float32(values[i])) for i in order]
        unique = sorted(set(ids))
        return unique, self._bias[mx.array(unique, dtype=mx.int32)].tolist()

    @property
    def _greedy_unpenalized(self) -> bool:
        return self.params.greedy and self._seen is None and self._counts is None

    @property
    def batch_bias(self) -> Optional[tuple[list[int], list[float]]]:
        """For a greedy row with no penalty, its logit bias as (token ids, values), which a batched
        forward adds before its one argmax (`ForwardRow.logit_bias`); None otherwise."""
        return self._bias_entries if self._bias is not None and self._greedy_unpenalized else None

    def takes_batch_choice(self, bias) -> bool:
        """Whether a batched forward's argmax taken after `bias` (`TargetOutput.choices_bias`) is
        this sampler's greedy choice: greedy, no penalty, and that bias its own (or none)."""
        return self._greedy_unpenalized and bias is self.batch_bias

    def commit(self, tokens: mx.array) -> None:
        """Record emitted tokens (int32 [n]) in the penalty histories."""
        if self._seen is not None:
            self._seen = self._seen.at[tokens].add(1.0)
        if self._counts is not None:
            self._counts = self._counts.at[tokens].add(1.0)

    def choose(self, logits: mx.array, drafts: Optional[mx.array], first_index: int,
               allowed: Optional[mx.array] = None) -> mx.array:
        """The target's choice for each row of `logits` [T, V] -> int32 [T].

        Row 0 follows the committed history; row i > 0 also follows drafts[:i] (int32 [T-1]).
        `first_index` is the index, among generated tokens, of the token row 0 chooses.
        `allowed` (bool [T, V], from a grammar) masks out the tokens each row may not choose.
        """
        p = self.params
        x = logits.astype(mx.float32)
        if allowed is not None:
            x = mx.where(allowed, x, -mx.inf)
        if self._bias is not None:
            x = x + self._bias
        if self._seen is not None or self._counts is not None:
            x = self._penalize(x, drafts)
        if p.greedy:
            return mx.argmax(x, axis=-1).astype(mx.int32)
        x = x / p.temperature
        if p.top_k and p.top_k < self.vocab_size:
            kth = mx.sort(x, axis=-1)[:, -p.top_k][:, None]
            x = mx.where(x >= kth, x, -mx.inf)
        if p.top_p < 1.0 or p.min_p > 0.0:
            probs = mx.softmax(x, axis=-1)
            if p.top_p < 1.0:
                ranked = mx.sort(probs, axis=-1)[:, ::-1]
                before = mx.cumsum(ranked, axis=-1) - ranked  # mass of strictly more likely tokens
                cutoff = mx.min(mx.where(before < p.top_p, ranked, mx.inf), axis=-1, keepdims=True)
                x = mx.where(probs >= cutoff, x, -mx.inf)
            if p.min_p > 0.0:
                x = mx.where(probs >= p.min_p * mx.max(probs, axis=-1, keepdims=True), x, -mx.inf)
        return mx.argmax(x + self._gumbel(first_index, x.shape[0]), axis=-1).astype(mx.int32)

    def _penalize(self, x: mx.array, drafts: Optional[mx.array]) -> mx.array:
        rows = x.shape[0]
        extra = 0.0
        if rows > 1:
            # Row i has also seen drafts[0..i-1]: cumulative one-hot counts, shifted by one row.
            one_hot = (drafts[:, None] == mx.arange(self.vocab_size)[None]).astype(mx.float32)
            extra = mx.concatenate([mx.zeros((1, self.vocab_size)), mx.cumsum(one_hot, axis=0)[: rows - 1]])
        p = self.params
        if self._seen is not None:
            seen = (self._seen + extra) > 0
            x = mx.where(seen, mx.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if self._counts is not None:
            counts = self._counts + extra
            x = x - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
        return x

    def _gumbel(self, first_index: int, rows: int) -> mx.array:
        """Gumbel noise [rows, V] that depends only on (seed, generated-token index, token id)."""
        if self._token_hash is None:
            ids = mx.arange(self.vocab_size, dtype=mx.uint32)
            self._token_hash = _mix32(ids * mx.array(0x9E3779B1, dtype=mx.uint32) + mx.array(0x7F4A7C15, dtype=mx.uint32))
        index = mx.arange(first_index, first_index + rows, dtype=mx.uint32)[:, None]
        row_key = _mix32(_mix32(index ^ self._seed_lo) + self._seed_hi)
        bits = _mix32(row_key ^ self._token_hash[None])
        # v = 1 - u on a grid of 2^-23: (k + 0.5) * 2^-23 is exact in float32 for every 23-bit k, so
        # v lies strictly inside (0, 1) and the noise is finite. (With 24-bit k and 2^-24 the top k
        # rounded to u = 1.0, an infinite noise: a uniformly random token won, about once in 2^24
        # draws, so once in ~64 tokens with a 262k vocabulary.) log1p keeps -log(u) exact near u = 1.
        v = ((bits >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))
        return -mx.log(-mx.log1p(-v))
