"""A stand-in drafter whose proposals are forced from the target's own continuation.

Random-weight drafters accept almost nothing, so they never exercise long acceptances. This one
proposes the reference (target-alone) tokens with one error planted at a chosen block position, so
exactly `schedule[cycle]` drafts are accepted each cycle (0..B-1, B-1 meaning full acceptance).
It implements the drafter interface the engine uses: config, block_size, make_cache, add_context,
propose.
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

    @property
    def config(self):
        return SimpleNamespace(target_layer_ids=self.target_layer_ids, block_size=self.block_size)

    def make_cache(self):
        return [_Context()]

    def add_context(self, taps, cache):
        assert taps.shape[1] >= 1
        cache[0].offset += taps.shape[1]

    def propose(self, bonus, target, cache, width=None):
        context = cache[0]
        accept = self.schedule[context.cycles % len(self.schedule)]
        context.cycles += 1
        start = context.offset  # position of the bonus token
        drafts = []
        for j in range(1, width or self.block_size):
            position = start + j
            token = self.reference[position] if position < len(self.reference) else 0
            if j == accept + 1:  # the first rejected draft
                token = (token + 1) % self.vocab_size
            drafts.append(token)
        return mx.array(drafts, dtype=mx.int32)
