"""A stand-in drafter whose proposals are forced from the target's own continuation.

Random-weight drafters accept almost nothing, so they never exercise long acceptances. This one
proposes the reference (target-alone) tokens with one error planted at a chosen block position, so
exactly `schedule[cycle]` drafts are accepted each cycle (0..B-1, B-1 meaning full acceptance).
It implements the drafter interface the engine uses: config, block_size, make_cache, add_context,
propose, and drafting ahead (`drafts_ahead`: a block whose start is on the device, before the host
has read the cycle before it), so that the engine's every path meets every acceptance length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import mlx.core as mx


@dataclass
class _Context:
    offset: int = 0
    cycles: int = 0


@dataclass
class ForcedDrafter:
    reference: list[int]  # prompt + target-alone continuation
    prompt_length: int
    schedule: list[int]
    vocab_size: int
    target_layer_ids: list[int] = field(default_factory=lambda: [0])
    block_size: int = 16
    drafts_ahead: bool = True
    drafted_ahead: int = 0  # blocks drafted ahead so far

    @property
    def config(self):
        return SimpleNamespace(target_layer_ids=self.target_layer_ids, block_size=self.block_size)

    def make_cache(self):
        return [_Context()]

    def add_context(self, taps, cache):
        assert taps.shape[1] >= 1
        cache[0].offset += taps.shape[1]

    def propose(self, bonus, target, cache, width=None, start=None):
        context = cache[0]
        accept = self.schedule[context.cycles % len(self.schedule)]
        context.cycles += 1
        width = width or self.block_size
        if start is not None:  # drafted ahead: the bonus token's position is on the device
            assert context.offset >= start[1] and start[0].dtype == mx.int32
            self.drafted_ahead += 1
            known = mx.array(self.reference + [0] * (width + 1), dtype=mx.int32)
            drafts = mx.take(known, start[0] + mx.arange(1, width))
            wrong = mx.arange(1, width) == accept + 1  # the first rejected draft
            return mx.where(wrong, (drafts + 1) % self.vocab_size, drafts).astype(mx.int32)
        start = context.offset  # position of the bonus token
        drafts = []
        for j in range(1, width):
            position = start + j
            token = self.reference[position] if position < len(self.reference) else 0
            if j == accept + 1:  # the first rejected draft
                token = (token + 1) % self.vocab_size
            drafts.append(token)
        return mx.array(drafts, dtype=mx.int32)


# Every acceptance length 0..15, each next to another far from it.
EVERY_LENGTH = [15, 0, 7, 1, 14, 2, 13, 3, 12, 4, 11, 5, 10, 6, 9, 8]


def tokens(chunks) -> list[int]:
    """A generation's token ids, its chunks joined."""
    return [t for c in chunks for t in c.token_ids]


def assert_every_acceptance_length_is_lossless(engine, prompt: list[int], max_tokens: int = 160) -> None:
    """The engine's target with a ForcedDrafter accepting every length 0..15 (16-row verifies
    against the 1-row steps of its target-alone reference) gives exactly that reference."""
    from dflash_core.engine import Engine

    reference = tokens(engine.generate(prompt, max_tokens=max_tokens + 16, speculative=False, stop_token_ids=set()))
    forced = ForcedDrafter(reference=list(prompt) + reference, prompt_length=len(prompt), schedule=EVERY_LENGTH,
                           vocab_size=engine.target.vocab_size,
                           target_layer_ids=engine.drafter.config.target_layer_ids)
    chunks = list(Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16).generate(
        prompt, max_tokens=max_tokens, stop_token_ids=set()))
    assert tokens(chunks) == reference[:max_tokens] and chunks[-1].stats.cycles >= len(EVERY_LENGTH)


def assert_batched_rows_are_as_alone(engine, prompt: list[int], max_tokens: int) -> None:
    """Three rows batched together (prompts of different lengths, speculating and plain mixed)
    each give exactly what they give alone."""
    from dflash_core.batching import generate_together

    requests = [dict(prompt_tokens=prompt[: len(prompt) - i], max_tokens=max_tokens, speculation=mode,
                     stop_token_ids=set()) for i, mode in enumerate(["on", "off", "on"])]
    for request, chunks in zip(requests, generate_together(engine, requests)):
        alone = tokens(engine.generate(request["prompt_tokens"], max_tokens=max_tokens, speculative=False,
                                        stop_token_ids=set()))
        assert tokens(chunks) == alone


def verify_and_steps(target, prompt: list[int], block: list[int]):
    """After `prompt`, the logits a verify of `block` (16 tokens) gives and those 16 one-token steps
    give, as numpy arrays."""
    import mlx.core as mx
    import numpy as np

    tokens_block = mx.array([block])
    caches = [target.make_cache(16), target.make_cache(16)]
    for cache in caches:
        mx.eval(target.forward(mx.array([prompt]), cache).logits)
    verify = target.forward(tokens_block, caches[0]).logits
    steps = mx.concatenate([target.forward(tokens_block[:, i : i + 1], caches[1]).logits
                            for i in range(len(block))], axis=1)
    return np.array(verify.astype(mx.float32)), np.array(steps.astype(mx.float32))  # (exact from bf16 too)


def context_difference(drafter, dtype=None) -> float:
    """The largest difference between a drafter's context K/V of 16 taps added at once (a verify's)
    and one at a time (plain steps'), taps in `dtype` (None: float32): 0 when its `fc` and
    projections round a row alike whatever rows share the product."""
    import mlx.core as mx

    mx.random.seed(5)
    taps = mx.random.normal((1, 16, drafter.fc.weight.shape[1]))
    taps = taps.astype(dtype) if dtype is not None else taps
    at_once, one_by_one = drafter.make_cache(), drafter.make_cache()
    drafter.add_context(taps, at_once)
    for i in range(16):
        drafter.add_context(taps[:, i : i + 1], one_by_one)
    return max(float(mx.abs(getattr(a, part)[..., :16, :].astype(mx.float32)
                            - getattr(b, part)[..., :16, :].astype(mx.float32)).max())
               for a, b in zip(at_once, one_by_one) for part in ("keys", "values"))


def assert_verify_is_single_steps(target, prompt: list[int], block: list[int]) -> None:
    """After `prompt`, a verify of `block` (16 tokens) gives each token the logits 16 one-token
    steps give it (what the token checks rest on; a last-bit difference would rarely change a
    token), as `assert_rounds_alike` compares them."""
    assert_rounds_alike(*verify_and_steps(target, prompt, block))


def assert_rounds_alike(a, b) -> None:
    """`a` and `b` (MLX or numpy arrays), computed with different row counts, are the same: to the
    bit on the CPU; on a GPU, where a 16-row and a 1-row product round differently (README), to
    float32 rounding."""
    import numpy as np

    from dflash_core.kernels import backend

    a, b = (np.array(x.astype(mx.float32)) if isinstance(x, mx.array) else x for x in (a, b))
    if backend() == "cpu":
        assert a.shape == b.shape and np.array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
