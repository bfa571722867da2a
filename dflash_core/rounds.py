"""What a batched round costs each of its rows: the price `speculation: auto` compares in a batch.

In a batch (`batching.step_together`) every row waits for the whole round, so the wall between a
row's reads is the round's, whatever that row did in it: eight rows of plain steps read as eight
"steps" of the round's full length, and one row's cycle among them costs that row only what it
adds. Judged by those walls, a drafter barely above one token per cycle looks worth running on a
machine where each row's cycle slows the whole batch (a CPU, where a verify of w tokens costs
about w plain rows).

So the rounds of a model are modelled: a round's wall W ≈ a + b·T + c·k, with T the target
tokens it verified or stepped (a plain row 1, a cycle's verify its width) and k the rows that
drafted, fitted by least squares over its recent rounds (older ones fading). In a round of N rows a
plain step's share is a/N + b, and a cycle of width w costs its row b·(w−1) + c more. A row cycles
when its expected tokens per second of those shares beat a plain step's, which is exactly when the
batch's tokens per second rise (and alone, N = 1, the solo rule). Directions the rounds seen so far
do not tell apart get the least-squares minimum-norm split: before any cycle has run in a batch a
verify token is priced like a plain row (the CPU's case), until a probe's round shows otherwise.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np


class RoundCosts:
    """One model's batched rounds: their composition and wall, and the shares they imply."""

    def __init__(self, forget: float = 0.98):
        self.forget = forget
        self.rows = 0  # decoding rows in the latest round (0: none, or not batched)
        self._gram = np.zeros((3, 3))
        self._moments = np.zeros(3)
        self._samples = 0
        self._coefficients: Optional[np.ndarray] = None
        self._shapes_seen: set[tuple[int, int, int]] = set()
        self._last: Optional[tuple[tuple[int, int, int, int], float]] = None

    def end_round(self, rows: int, tokens: int, drafting: int, widest: int, clean: bool,
                  now: Optional[float] = None) -> None:
        """A round ended: `rows` rows made forwards of `tokens` target tokens in all (the widest
        row `widest`), `drafting` of them drafted. Its forwards run while the next round reads
        them, so it is the next round's wall that is this one's cost; a round is `clean` when no
        row in it did other work on the host's time (a prefill chunk, the prompt's last chunk
        read for the first token), and only then does it time the round before it."""
        now = time.perf_counter() if now is None else now
        last = self._last
        self._last = ((rows, tokens, drafting, widest), now) if rows else None
        self.rows = rows
        if last is None or not clean:
            return
        (n, t, k, wmax), ended = last
        shape = (n, wmax, k)
        if shape not in self._shapes_seen:  # a new shape: MLX compiled during it
            self._shapes_seen.add(shape)
            return
        self.record(t, k, now - ended)

    def record(self, tokens: int, drafting: int, seconds: float) -> None:
        x = np.array([1.0, tokens, drafting])
        self._gram = self.forget * self._gram + np.outer(x, x)
        self._moments = self.forget * self._moments + x * seconds
        self._samples += 1
        self._coefficients = None

    def coefficients(self) -> Optional[np.ndarray]:
        """(a, b, c) of W ≈ a + b·T + c·k; None before any round was timed."""
        if not self._samples:
            return None
        if self._coefficients is None:
            self._coefficients = np.linalg.lstsq(self._gram, self._moments, rcond=1e-10)[0]
        return self._coefficients

    def step_share(self, rows: int) -> Optional[float]:
        """A plain step's share of a round of `rows` rows."""
        theta = self.coefficients()
        if theta is None:
            return None
        a, b, _ = theta
        return max(a / rows + b, 1e-7)

    def cycle_extra(self, width: int) -> Optional[float]:
        """What a cycle of `width` adds to its round over that row's plain step (never below 0)."""
        theta = self.coefficients()
        if theta is None:
            return None
        _, b, c = theta
        return max(b * (width - 1) + c, 0.0)
