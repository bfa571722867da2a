"""rounds.RoundCosts: a batched round's wall modelled as a fixed cost plus each row's, by what the
row did, and the prices that gives a row's plain step and cycles."""

from __future__ import annotations

import pytest

from dflash_core.rounds import RoundCosts


def _play(costs, rounds, wall):
    """End each round (its rows' widths: 1 a plain step, w a cycle) in turn, taking wall(widths)."""
    now = 0.0
    for widths in rounds:
        costs.end_round(widths, True, now)
        now += wall(widths)


def _wall(widths):  # 4 ms, 0.5 ms a plain row, 1.5 ms + 0.1 ms per verified token a cycling row
    return 0.004 + sum(0.0005 if w == 1 else 0.0015 + 0.0001 * w for w in widths)


def test_rounds_of_different_make_give_each_kind_of_row_its_cost():
    costs = RoundCosts()
    rounds = [[1] * 8, [1] * 7, [1] * 6, [16] + [1] * 7, [4] + [1] * 7, [16, 16] + [1] * 6]
    _play(costs, rounds * 10, _wall)
    theta = costs.coefficients()
    assert (theta[0], theta[1], theta[16], theta[4]) == pytest.approx((0.004, 0.0005, 0.0031, 0.0019), rel=1e-6)
    step, cycles = costs.prices(8, [16, 8, 4, 2])
    assert step == pytest.approx(0.004 / 8 + 0.0005)
    assert cycles[16] == pytest.approx(0.004 / 8 + 0.0031) and cycles[4] == pytest.approx(0.004 / 8 + 0.0019)
    # Width 8, never timed: between 4 and 16; width 2: the verify tokens of width 4 past the first.
    assert cycles[8] == pytest.approx(cycles[4] + (cycles[16] - cycles[4]) * 4 / 12)
    assert cycles[2] == pytest.approx(step + (cycles[4] - step) / 3)
    assert costs.rows == 8


def test_rounds_where_every_row_does_the_same_price_each_row_at_its_share():
    """Only all-plain and all-cycling rounds of 16 rows: the fixed cost is not told from the rows',
    but a plain step costs a sixteenth of a plain round and a cycle a sixteenth of a cycling one,
    which is the choice between those two rounds the batch as a whole faces."""
    costs = RoundCosts()
    rounds = ([[16] * 16] * 32 + [[1] * 16]) * 3
    _play(costs, rounds, lambda widths: 0.017 if widths[0] == 1 else 0.049)
    step, cycles = costs.prices(16, [16, 8, 4, 2])
    assert step == pytest.approx(0.017 / 16, rel=1e-3) and cycles[16] == pytest.approx(0.049 / 16, rel=1e-3)
    assert step < cycles[2] < cycles[4] < cycles[8] < cycles[16]


def test_a_round_times_the_one_before_only_when_clean_and_of_a_known_shape():
    costs = RoundCosts()
    assert costs.coefficients() is None and costs.prices(4, [16]) is None
    costs.end_round([1] * 4, True, 0.0)
    costs.end_round([1] * 4, True, 1.0)  # the shape's first round compiled: not a sample
    assert costs.coefficients() is None
    costs.end_round([1] * 4, False, 2.0)  # a prefill chunk ran in it: its wall is not the round's
    assert costs.coefficients() is None
    costs.end_round([1] * 4, True, 2.5)
    step, cycles = costs.prices(4, [16])
    assert step == pytest.approx(0.5 / 4, rel=0.01) and cycles == {}  # no cycle timed: none priced
    costs.end_round([], True, 3.0)  # no forwards: nothing to time next
    costs.end_round([1] * 4, True, 9.0)
    assert costs.prices(4, [16])[0] == pytest.approx(0.5 / 4, rel=0.01) and costs.rows == 4


def test_a_cycle_is_never_priced_at_or_below_a_plain_step():
    """Rounds that cannot tell a cycling row from a plain one (the same wall either way) price a
    cycle above a step: at a tie, a row whose drafts were ever accepted would keep cycling for
    nothing (its expected tokens per cycle are above 1)."""
    costs = RoundCosts()
    rounds = [[1] * 6, [2] + [1] * 5, [16] + [1] * 5] * 20
    _play(costs, rounds, lambda widths: 0.006)
    step, cycles = costs.prices(6, [16, 8, 4, 2])
    assert step == pytest.approx(0.001, rel=1e-3)
    assert all(c >= RoundCosts.CYCLE_FLOOR * step for c in cycles.values()), cycles
