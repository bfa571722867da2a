"""Reuse the longest cached prefix of a prompt across requests (agent loops resend everything).

A snapshot is the exact state after a token sequence: the target's caches (attention KV,
GatedDeltaNet conv and recurrent states, sliding-window rings) and the drafter's context K/V, so
that acceptance does not drop after a hit. Hybrid models cannot trim a state back, so snapshots
are taken where a later prompt is likely to diverge: after each end-of-turn token (message
boundaries), at the end of each prompt (with its last logits, for exact repeats), and at the end
of a generation. A new request restores the longest snapshot that is a prefix of its prompt and
computes only the rest.

Memory: a snapshot holds copies in buffers of their own (`cache.freeze`), and books what the
allocator really gave them (MLX's active memory before and after the copies; a small array may
get a larger cached buffer), so the budget bounds the memory the process holds. One
`SnapshotBudget` can be shared by the caches of several models (a server's models share one
budget); the least recently used snapshot of any of them goes first.
When a request that restored a snapshot stores a longer one extending it, the restored one is
pruned: its conversation has moved on. The first message boundary of a prompt (typically the
system prompt, shared by many conversations) is exempt and leaves only by LRU eviction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import mlx.core as mx

from .cache import cache_arrays, freeze, frozen_arrays, owned, thaw


@dataclass(eq=False)  # compared by identity: fields hold arrays
class Snapshot:
    tokens: tuple[int, ...]
    target: list
    context: Optional[list]  # the drafter's context K/V; None when taken without a drafter
    logits: Optional[mx.array] = None  # [V] logits after the last token, for a prompt repeated exactly
    shared: bool = False  # a first message boundary: kept when a conversation moves past it
    nbytes: int = 0  # the memory its arrays hold, as the allocator counts it
    last_used: float = field(default_factory=time.monotonic)

    def restore(self) -> tuple[list, Optional[list]]:
        return thaw(self.target), (thaw(self.context) if self.context is not None else None)


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0


class SnapshotBudget:
    """A byte budget for the snapshots of one or more prefix caches."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.caches: list[PrefixCache] = []

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def make_room(self, nbytes: int = 0) -> None:
        """Evict least recently used snapshots, of any cache, until `nbytes` more fit."""
        while self.nbytes + nbytes > self.budget_bytes:
            owned = [(s, c) for c in self.caches for s in c.snapshots]
            if not owned:
                return
            snapshot, cache = min(owned, key=lambda sc: sc[0].last_used)
            cache.snapshots.remove(snapshot)


def allocated(arrays: list[mx.array]) -> int:
    """Evaluate `arrays` and return the memory the allocator handed out for them. The device is
    idle first (a generation's queued step may be running), so the difference is these alone;
    their inputs must already be evaluated."""
    mx.synchronize()
    before = mx.get_active_memory()
    mx.eval(arrays)
    return mx.get_active_memory() - before


class PrefixCache:
    def __init__(self, budget: Union[int, SnapshotBudget], measured: bool = True):
        self.budget = budget if isinstance(budget, SnapshotBudget) else SnapshotBudget(budget)
        # measured=False: snapshots count their arrays' nominal bytes, not what the allocator handed
        # out, so that ranks of a distributed group evict the same snapshots at the same time.
        self.measured = measured
        self.budget.caches.append(self)
        self.snapshots: list[Snapshot] = []
        self.stats = PrefixCacheStats()

    @property
    def budget_bytes(self) -> int:
        return self.budget.budget_bytes

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
                mx.eval(logits)
                existing.logits = owned(logits)  # `logits` may be a view of a larger row
                existing.nbytes += max(logits.nbytes, allocated([existing.logits]) if self.measured else 0)
                mx.eval(existing.logits)
        else:
            # The copies' sources are evaluated first, so measuring the copies counts only them.
            mx.eval(cache_arrays(target), cache_arrays(context or []), logits if logits is not None else [])
            frozen_target = freeze(target)
            frozen_context = freeze(context) if context is not None else None
            arrays = frozen_arrays(frozen_target) + (frozen_arrays(frozen_context) if frozen_context else [])
            if logits is not None:
                logits = owned(logits)
                arrays.append(logits)
            # Sizes are known before anything is copied: decide first, copy only what is kept.
            nominal = sum(a.nbytes for a in arrays)
            if nominal > self.budget_bytes:
                return
            if existing is not None:  # a snapshot without drafter context is superseded
                self.snapshots.remove(existing)
            self.budget.make_room(nominal)
            if self.measured:
                nbytes = max(nominal, allocated(arrays))
            else:
                mx.eval(arrays)
                nbytes = nominal
            self.snapshots.append(Snapshot(tokens, frozen_target, frozen_context, logits, shared, nbytes))
        if (
            extends is not None
            and not extends.shared
            and extends in self.snapshots
            and len(tokens) > len(extends.tokens)
            and tokens[: len(extends.tokens)] == extends.tokens
        ):
            self.snapshots.remove(extends)
        self.budget.make_room()

    def clear(self) -> None:
        self.snapshots.clear()

    def close(self) -> None:
        """Leave the shared budget (the model is unloaded); its snapshots go with it."""
        self.clear()
        if self in self.budget.caches:
            self.budget.caches.remove(self)
