"""Reuse the longest cached prefix of a prompt across requests (agent loops resend everything).

A snapshot is the exact state after a token sequence: the target's caches (attention KV,
GatedDeltaNet conv and recurrent states, sliding-window rings) and the drafter's context K/V, so
that acceptance does not drop after a hit. Hybrid models cannot trim a state back, so snapshots
are taken where a later prompt is likely to diverge: after each end-of-turn token (message
boundaries), at the end of each prompt (with its last logits, for exact repeats), and at the end
of a generation. A new request restores the longest snapshot that is a prefix of its prompt and
computes only the rest.

Memory is accounted from the real array sizes against a byte budget, least recently used first.
When a request that restored a snapshot stores a longer one extending it, the restored one is
pruned: its conversation has moved on. The first message boundary of a prompt (typically the
system prompt, shared by many conversations) is exempt and leaves only by LRU eviction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx

from .cache import freeze, frozen_arrays, thaw


@dataclass(eq=False)  # compared by identity: fields hold arrays
class Snapshot:
    tokens: tuple[int, ...]
    target: list
    context: Optional[list]  # the drafter's context K/V; None when taken without a drafter
    logits: Optional[mx.array] = None  # [V] logits after the last token, for a prompt repeated exactly
    shared: bool = False  # a first message boundary: kept when a conversation moves past it
    nbytes: int = 0
    last_used: float = field(default_factory=time.monotonic)

    def restore(self) -> tuple[list, Optional[list]]:
        return thaw(self.target), (thaw(self.context) if self.context is not None else None)


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.snapshots: list[Snapshot] = []
        self.stats = PrefixCacheStats()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    def lookup(self, prompt: Sequence[int], need_context: bool) -> Optional[Snapshot]:
        """The longest usable snapshot whose tokens start `prompt`."""
        prompt = tuple(prompt)
        best = None
        for s in self.snapshots:
            n = len(s.tokens)
            if n > len(prompt) or (n == len(prompt) and s.logits is None):
                continue  # at least one token must be left to compute, unless logits were kept
            if need_context and s.context is None:
                continue
            if (best is None or n > len(best.tokens)) and prompt[:n] == s.tokens:
                best = s
        if best is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
            self.stats.reused_tokens += len(best.tokens)
            best.last_used = time.monotonic()
        return best

    def insert(self, tokens: Sequence[int], target: list, context: Optional[list], *, logits=None,
               shared: bool = False, extends: Optional[Snapshot] = None) -> None:
        """Store the state after `tokens`. `extends`: the snapshot this request started from."""
        tokens = tuple(tokens)
        if not tokens or self.budget_bytes <= 0:
            return
        existing = next((s for s in self.snapshots if s.tokens == tokens), None)
        if existing is not None and (existing.context is not None or context is None):
            existing.last_used = time.monotonic()
            existing.shared = existing.shared or shared
            if logits is not None and existing.logits is None:
                existing.logits = logits
                existing.nbytes += logits.nbytes
        else:
            frozen_target = freeze(target)
            frozen_context = freeze(context) if context is not None else None
            arrays = frozen_arrays(frozen_target) + (frozen_arrays(frozen_context) if frozen_context else [])
            if logits is not None:
                arrays.append(logits)
            # Sizes are known before anything is copied: decide first, copy only what is kept.
            nbytes = sum(a.nbytes for a in arrays)
            if nbytes > self.budget_bytes:
                return
            if existing is not None:  # a snapshot without drafter context is superseded
                self.snapshots.remove(existing)
            self._evict(room_for=nbytes)
            mx.eval(arrays)
            self.snapshots.append(Snapshot(tokens, frozen_target, frozen_context, logits, shared, nbytes))
        if (
            extends is not None
            and not extends.shared
            and extends in self.snapshots
            and len(tokens) > len(extends.tokens)
            and tokens[: len(extends.tokens)] == extends.tokens
        ):
            self.snapshots.remove(extends)
        self._evict()

    def _evict(self, room_for: int = 0) -> None:
        while self.snapshots and self.nbytes + room_for > self.budget_bytes:
            self.snapshots.remove(min(self.snapshots, key=lambda s: s.last_used))

    def clear(self) -> None:
        self.snapshots.clear()
