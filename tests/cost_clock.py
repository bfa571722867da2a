"""A clock for `auto` that a cost model advances: tests of auto's choices on real models that do not
hang on the load of the machine running them (a 2-core CI box running other tests' compiles
beside this one turns a wall-clock judgment into a coin toss).

`CostedTarget` wraps a real target adapter and charges each forward its modeled cost on a
`CostClock`; the engine built with `clock=` reads that clock where it would read the wall. The
forwards themselves are the real model's: only their timing is modeled."""

from __future__ import annotations


class CostClock:
    """Seconds of modeled device time. A plain step of one row costs `step`; each further token of a
    forward (a cycle's drafts, a drafter's block folded in) `per_token`; a batched forward of several
    rows `round_base` more, once. `lag`: how many forwards behind the queue the charge runs: 0 for a
    generation alone, whose step is read before the next is queued, so the wall between two reads is
    the step read; 1 for batched rounds, whose forwards are read in the next round
    (rounds.py: the next round's wall is a round's cost)."""

    def __init__(self, step: float = 0.01, per_token: float = 0.003, round_base: float = 0.002, lag: int = 0):
        self.step, self.per_token, self.round_base, self.lag = step, per_token, round_base, lag
        self.now = 0.0
        self._owed: list[float] = []

    def __call__(self) -> float:
        return self.now

    def forward_cost(self, width: int) -> float:
        """A row's forward of `width` tokens (1: a plain step)."""
        return self.step + self.per_token * (width - 1)

    def charge(self, widths: list[int]) -> None:
        cost = sum(self.forward_cost(w) for w in widths)
        self._owed.append(cost + (self.round_base if len(widths) > 1 else 0.0))
        while len(self._owed) > self.lag:
            self.now += self._owed.pop(0)


class CostedTarget:
    """A target adapter whose forwards charge `clock`; everything else is the adapter's own."""

    def __init__(self, target, clock: CostClock):
        self._target, self._clock = target, clock

    def __getattr__(self, name):
        return getattr(self._target, name)

    def forward(self, tokens, cache, *args, **kwargs):
        self._clock.charge([tokens.shape[-1]])
        return self._target.forward(tokens, cache, *args, **kwargs)

    def forward_rows(self, rows, *args, **kwargs):
        self._clock.charge([r.tokens.shape[-1] for r in rows])
        return self._target.forward_rows(rows, *args, **kwargs)
