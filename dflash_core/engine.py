"""The DFlash decode loop and its target-alone twin, over the same adapters and the same sampler.

`Engine.generate` is the streaming API: an iterator of `GenerationChunk`s (token ids and the text
they complete), the last one carrying the finish reason and `GenerationStats`. Each `next()` does a
bounded amount of device work (one prefill chunk or one cycle), so a scheduler can interleave many
generations fairly, and closing the iterator cancels the generation and frees its caches.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional, Sequence

import mlx.core as mx

from .adapters import TargetAdapter
from .detokenize import IncrementalDetokenizer
from .drafter import DFlashDrafter
from .sampling import Sampler, SamplingParams


@dataclass
class GenerationStats:
    """What one generation did; documented key by key in README.md ("Statistics")."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    generated_tokens: int = 0
    speculative: bool = False
    speculative_off_reason: Optional[str] = None
    block_size: int = 0
    cycles: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)

    @property
    def tokens_per_cycle(self) -> float:
        """Tokens committed per verify cycle: accepted drafts plus the target's own token."""
        return (self.draft_tokens_accepted + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of cycles in which the draft at block position i (1..B-1) was accepted."""
        return [n / self.cycles if self.cycles else 0.0 for n in self.accepted_by_position]

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes from prefill; decode time covers the rest.
        return (self.generated_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def record_cycle(self, accepted: int) -> None:
        self.cycles += 1
        self.draft_tokens_proposed += self.block_size - 1
        self.draft_tokens_accepted += accepted
        for i in range(accepted):
            self.accepted_by_position[i] += 1

    def as_dict(self) -> dict:
        out = asdict(self)
        out["tokens_per_cycle"] = self.tokens_per_cycle
        out["acceptance_by_position"] = self.acceptance_by_position
        out["decode_tokens_per_second"] = self.decode_tokens_per_second
        return out


@dataclass
class GenerationChunk:
    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None  # "stop" (an end-of-sequence token) or "length"
    stats: Optional[GenerationStats] = None  # the generation's live statistics, final on the last chunk


def accepted_length(drafts: Sequence[int], choices: Sequence[int]) -> int:
    """Drafts accepted: the longest prefix where each draft equals the target's choice before it."""
    n = 0
    while n < len(drafts) and drafts[n] == choices[n]:
        n += 1
    return n


class Engine:
    def __init__(
        self,
        target: TargetAdapter,
        tokenizer,
        drafter: Optional[DFlashDrafter] = None,
        *,
        prefill_chunk: int = 2048,
        max_context: Optional[int] = None,
        drafter_off_reason: Optional[str] = None,
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.prefill_chunk = prefill_chunk
        self.max_context = max_context
        # Why there is no drafter, reported with every generation that runs without one.
        self.drafter_off_reason = drafter_off_reason or "no drafter configured"

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    def generate(
        self,
        prompt_tokens: Sequence[int],
        *,
        max_tokens: Optional[int] = None,
        sampling: SamplingParams = SamplingParams(),
        speculative: bool = True,
        stop_token_ids: Optional[set[int]] = None,
    ) -> Iterator[GenerationChunk]:
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        sampling.validate(self.target.vocab_size)
        budget = max_tokens if max_tokens is not None else 1 << 62
        if self.max_context is not None:
            budget = min(budget, self.max_context - len(prompt_tokens))
        if budget < 1:
            raise ValueError(f"no room to generate: prompt has {len(prompt_tokens)} tokens, limit {self.max_context}")
        stats = GenerationStats(prompt_tokens=len(prompt_tokens), prefill_tokens=len(prompt_tokens))
        if self.drafter is None:
            stats.speculative_off_reason = self.drafter_off_reason
        elif not speculative:
            stats.speculative_off_reason = "disabled by request"
        else:
            stats.speculative = True
            stats.block_size = self.drafter.block_size
            stats.accepted_by_position = [0] * (self.drafter.block_size - 1)
        eos = self.eos_token_ids if stop_token_ids is None else set(stop_token_ids)
        return self._stream(prompt_tokens, budget, sampling, stats, eos)

    def _stream(self, prompt, budget, sampling, stats, eos) -> Iterator[GenerationChunk]:
        sampler = Sampler(sampling, self.target.vocab_size, prompt)
        steps = self._speculative(prompt, sampler, stats) if stats.speculative else self._target_only(prompt, sampler)
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        start = time.perf_counter()
        decode_start = None
        try:
            for ids in steps:
                if not ids:  # a prefill chunk: give the caller a chance to interleave
                    yield GenerationChunk([], "", stats=stats)
                    continue
                now = time.perf_counter()
                if decode_start is None:
                    decode_start = now
                    stats.prefill_seconds = now - start
                ids = ids[: budget - stats.generated_tokens]
                finish = "length" if stats.generated_tokens + len(ids) >= budget else None
                for i, token in enumerate(ids):
                    if token in eos:
                        ids, finish = ids[:i], "stop"
                        break
                stats.generated_tokens += len(ids)
                text = detokenizer.add(ids)
                stats.decode_seconds = time.perf_counter() - decode_start
                if finish:
                    yield GenerationChunk(ids, text + detokenizer.flush(), finish, stats)
                    return
                yield GenerationChunk(ids, text, stats=stats)
        finally:
            steps.close()

    def _prefill(self, prompt, cache, tap_ids=(), on_taps=None):
        """Chunked prefill; yields between chunks and returns the last position's logits."""
        tokens = mx.array(prompt, dtype=mx.int32)[None]
        for begin in range(0, len(prompt), self.prefill_chunk):
            out = self.target.forward(tokens[:, begin : begin + self.prefill_chunk], cache, tap_ids, last_logits_only=True)
            if on_taps is not None:
                on_taps(out.taps)
            if begin + self.prefill_chunk < len(prompt):
                mx.eval(out.logits, cache_arrays(cache))  # bound the graph and the memory of one chunk
                yield []
        return out.logits[0]

    def _target_only(self, prompt, sampler: Sampler) -> Iterator[list[int]]:
        cache = self.target.make_cache(max_rollback=0)
        logits = yield from self._prefill(prompt, cache)
        token = sampler.choose(logits, None, 0)
        index = 0
        while True:
            sampler.commit(token)
            # Queue the next step before reading this token: the device never waits for the host.
            next_token = sampler.choose(self.target.forward(token[None], cache).logits[0], None, index + 1)
            mx.async_eval(next_token)
            yield token.tolist()
            token, index = next_token, index + 1

    def _speculative(self, prompt, sampler: Sampler, stats: GenerationStats) -> Iterator[list[int]]:
        target, drafter = self.target, self.drafter
        tap_ids, block = drafter.config.target_layer_ids, drafter.block_size
        cache, context = target.make_cache(max_rollback=block), drafter.make_cache()
        logits = yield from self._prefill(prompt, cache, tap_ids, lambda taps: drafter.add_context(taps, context))
        bonus = sampler.choose(logits, None, 0)
        sampler.commit(bonus)
        proposals = drafter.propose(bonus, target, context)
        mx.async_eval(proposals)
        yield bonus.tolist()
        index = 0  # generated-token index of the bonus token
        while True:
            verify = target.forward(mx.concatenate([bonus, proposals])[None], cache, tap_ids, record=True)
            choices = sampler.choose(verify.logits[0], proposals, index + 1)
            host = mx.concatenate([proposals, choices]).tolist()  # the one blocking read per cycle
            drafts, picks = host[: block - 1], host[block - 1 :]
            accepted = accepted_length(drafts, picks)
            target.rollback(cache, verify.tape, keep=accepted + 1)
            drafter.add_context(verify.taps[:, : accepted + 1], context)
            bonus = choices[accepted : accepted + 1]
            committed = drafts[:accepted] + [picks[accepted]]
            sampler.commit(mx.array(committed, dtype=mx.int32))
            proposals = drafter.propose(bonus, target, context)
            mx.async_eval(proposals)  # the next draft runs while the host hands out tokens
            stats.record_cycle(accepted)
            index += accepted + 1
            yield committed


def cache_arrays(cache: list) -> list[mx.array]:
    """Every array a list of layer caches holds (for eval and for memory accounting)."""
    arrays = []
    for c in cache:
        if c is None:
            continue
        if hasattr(c, "cache"):  # mlx-lm ArraysCache (GatedDeltaNet conv and recurrent state)
            arrays.extend(a for a in c.cache if a is not None)
        elif getattr(c, "keys", None) is not None:
            arrays.extend([c.keys, c.values])
    return arrays
