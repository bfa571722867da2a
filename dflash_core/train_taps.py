"""The target's tapped hidden states of training sequences, for `dflash train`.

The target is frozen, so a sequence's taps never change: `TapCache` keeps them (within a byte
budget) instead of running the target again every time the sequence is drawn.
"""

from __future__ import annotations

import time

import mlx.core as mx


def padded_tokens(sequences: list[list[int]]) -> mx.array:
    """Token ids [N, longest], each sequence padded at its end with 0."""
    longest = max(len(t) for t in sequences)
    return mx.array([t + [0] * (longest - len(t)) for t in sequences], dtype=mx.int32)


def target_taps(target, sequences: list[list[int]], tap_ids) -> list[mx.array]:
    """Each sequence's taps [1, S_i, D] from one target forward of them all, padded at their ends
    (a causal target never lets a position see what comes after it). One forward per sequence was
    what a training step cost on a GPU: a few hundred small launches each.

    Each result is a slice of the batch's taps and shares its memory: copy one before keeping it
    longer than the batch."""
    tokens = padded_tokens(sequences)
    out = target.forward(tokens, target.make_cache(max_rollback=0), tap_ids, last_logits_only=True)
    taps = mx.stop_gradient(out.tapped_hidden)
    return [taps[i : i + 1, : len(s)] for i, s in enumerate(sequences)]


class TapCache:
    """Taps of the training sequences by index: kept ones, and the others from one target forward
    of them together. New taps are kept while their bytes fit `budget_bytes`; `kept_bytes` is what
    the kept ones hold. `report()` says how often the target ran and for how long, which tells
    whether the target or the drafter bounds a training step."""

    def __init__(self, target, sequences: list[list[int]], tap_ids, budget_bytes: int):
        self.target = target
        self.sequences = sequences
        self.tap_ids = tap_ids
        self.budget_bytes = budget_bytes
        self.kept: dict[int, mx.array] = {}
        self.kept_bytes = 0
        self.hits = self.misses = 0
        self.target_seconds = 0.0  # target forwards, evaluated apart from the drafter's step

    def __call__(self, indices: list[int]) -> list[mx.array]:
        missing = [i for i in indices if i not in self.kept]
        self.hits += len(indices) - len(missing)
        self.misses += len(missing)
        new = {}
        if missing:
            start = time.perf_counter()
            new = dict(zip(missing, target_taps(self.target, [self.sequences[i] for i in missing], self.tap_ids)))
            mx.eval(list(new.values()))
            self.target_seconds += time.perf_counter() - start
        copies = []
        for i, taps in new.items():
            if self.kept_bytes + taps.nbytes <= self.budget_bytes:
                # A copy: the slice alone keeps the whole batch's taps alive, many times the bytes
                # it counts against the budget (what ran an 80 GB GPU out of memory in training).
                self.kept[i] = mx.contiguous(taps)
                copies.append(self.kept[i])
                self.kept_bytes += taps.nbytes
        mx.eval(copies)  # together: one wait for the device, not one per sequence
        return [self.kept.get(i, new.get(i)) for i in indices]

    def report(self) -> dict:
        return {"dtype": str(self.target.dtype).removeprefix("mlx.core."),
                "kept_sequences": len(self.kept), "kept_gb": round(self.kept_bytes / 1e9, 3),
                "budget_gb": round(self.budget_bytes / 1e9, 3), "hits": self.hits, "misses": self.misses,
                "target_seconds": round(self.target_seconds, 2)}
