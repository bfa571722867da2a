"""What a batched round costs each of its rows: the price `speculation: auto` compares in a batch.

In a batch (`batching.step_together`) every row waits for the whole round, so the wall between a
row's reads is the round's, whatever that row did in it: eight rows of plain steps read as eight
"steps" of the round's full length, and one row's cycle among them costs that row only what it
adds. Judged by those walls, a drafter barely above one token per cycle looks worth running on a
machine where each row's cycle slows the whole batch (a CPU, where a verify of w tokens costs
about w plain rows).

So the rounds of a model are modelled: a round's wall W ≈ a + p·(plain rows) + Σ_w q_w·(rows
cycling at width w), its draft and verify included, fitted by least squares over its recent
rounds (older ones fading). In a round of N rows a plain step's price is a/N + p and a cycle's
a/N + q_w. A row cycles when its expected tokens per second at those prices beat a plain step's,
which is exactly when the batch's tokens per second rise (and alone, N = 1, the solo rule).
Rounds where every row does the same thing do not tell the fixed cost a from the rows' costs;
the least-squares minimum-norm split then prices each row at its share of the round, which makes
the decision the batch as a whole would make between those two kinds of round; a probe (one row
cycling among plain steps) shows what one row's cycle adds. A width never timed in a batch is
priced from those that were: between two, linearly; below the narrowest, its verify tokens
beyond the first costing what the narrowest's do; above the widest, as the widest.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class RoundCosts:
    """One model's batched rounds: what each kind of row cost in them, and the prices that gives."""

    KNOWN = 0.05  # a kind of row is timed while its fading count of rounds is above this
    # A cycle runs a drafter forward and verifies two tokens or more: never cheaper than a plain
    # step of the same round, and priced at least this much above one. At a bare tie (a fit that
    # cannot tell a narrow cycle from a step) a row whose drafts were ever accepted by chance
    # would otherwise keep cycling, since its expected tokens per cycle are then above 1.
    CYCLE_FLOOR = 1.05

    def __init__(self, max_width: int = 16, forget: float = 0.98):
        self.forget = forget
        self.rows = 0  # decoding rows in the latest round (0: none, or not batched)
        self.ended = 0  # rounds ended so far: the rows planning now plan round `ended` + 1
        # Columns: the round's fixed cost, plain rows, then rows cycling at width 2..max_width.
        self._columns = max_width + 1
        self._gram = np.zeros((self._columns, self._columns))
        self._moments = np.zeros(self._columns)
        self._coefficients: Optional[np.ndarray] = None
        self._shapes_seen: set[tuple[int, ...]] = set()
        self._last: Optional[tuple[list[int], float]] = None

    def end_round(self, widths: Sequence[int], clean: bool, now: float) -> None:
        """A round ended in which these rows made target forwards, each of `widths` tokens (1: a
        plain step, w > 1: a cycle verifying w). Its forwards run while the next round reads
        them, so it is the next round's wall that is this one's cost; a round is `clean` when no
        row in it did other work on the host's time (a prefill chunk, the prompt's last chunk
        read for its first token), and only then does it time the round before it. `now`: the
        engine's clock (seconds) at the round's end."""
        last = self._last
        self._last = (list(widths), now) if widths else None
        self.rows = len(widths)
        self.ended += 1
        if last is None or not clean:
            return
        before, ended = last
        shape = (len(before), max(before), sum(w > 1 for w in before))
        if shape not in self._shapes_seen:  # a new shape: MLX compiled during it
            self._shapes_seen.add(shape)
            return
        self.record(before, now - ended)

    def record(self, widths: Sequence[int], seconds: float) -> None:
        x = np.zeros(self._columns)
        x[0] = 1.0
        for w in widths:
            x[min(w, self._columns - 1) if w > 1 else 1] += 1
        self._gram = self.forget * self._gram + np.outer(x, x)
        self._moments = self.forget * self._moments + x * seconds
        self._coefficients = None

    def coefficients(self) -> Optional[np.ndarray]:
        """(a, p, q_2 .. q_max): the fixed cost, a plain row's, a cycling row's by width (0 where
        never timed); None before any round was timed."""
        if not self._gram[0, 0]:
            return None
        if self._coefficients is None:
            self._coefficients = np.linalg.lstsq(self._gram, self._moments, rcond=1e-10)[0]
        return self._coefficients

    def prices(self, rows: int, widths: Sequence[int]) -> Optional[tuple[float, dict[int, float]]]:
        """A plain step's price in a round of `rows` rows, and each of `widths`' cycle's (those
        that can be priced: timed, or between or beside timed ones); None until plain rows were
        timed."""
        theta = self.coefficients()
        if theta is None or self._gram[1, 1] < self.KNOWN:
            return None
        a, p = theta[0], theta[1]
        step = max(a / rows + p, 1e-7)
        floor = step * self.CYCLE_FLOOR
        timed = {w: max(a / rows + theta[w], floor) for w in range(2, self._columns) if self._gram[w, w] >= self.KNOWN}
        cycles = {}
        for w in widths:
            below, above = [t for t in timed if t <= w], [t for t in timed if t >= w]
            if below and above:
                lo, hi = max(below), min(above)
                cycles[w] = timed[lo] if lo == hi else timed[lo] + (timed[hi] - timed[lo]) * (w - lo) / (hi - lo)
            elif above:  # narrower than any timed: the narrowest's cost per verify token past the first
                hi = min(above)
                cycles[w] = max(floor, step + (timed[hi] - step) * (w - 1) / (hi - 1))
            elif below:
                cycles[w] = timed[max(below)]
        return step, cycles
