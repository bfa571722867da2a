"""rounds.RoundCosts: the batched rounds' model W ≈ a + b·T + c·k and the shares it gives a row."""

from __future__ import annotations

import pytest

from dflash_core.rounds import RoundCosts


def _play(costs, rounds, wall):
    """End each (rows, tokens, drafting, widest) round in turn, each taking wall(tokens, drafting)."""
    now = 0.0
    for i, (rows, tokens, drafting, widest) in enumerate(rounds):
        costs.end_round(rows, tokens, drafting, widest, True, now)
        now += wall(tokens, drafting)


def test_the_shares_of_a_round_come_from_rounds_of_different_make():
    costs = RoundCosts()

    def wall(tokens, drafting):
        return 0.004 + 0.0005 * tokens + 0.002 * drafting

    # Plain rounds of 6, 7 and 8 rows, and rounds with one or two rows cycling at widths 16 and 4.
    shapes = [(8, 8, 0, 1), (7, 7, 0, 1), (6, 6, 0, 1), (8, 23, 1, 16), (8, 11, 1, 4), (8, 38, 2, 16)]
    _play(costs, shapes * 10, wall)
    a, b, c = costs.coefficients()
    assert (a, b, c) == pytest.approx((0.004, 0.0005, 0.002), rel=1e-6)
    assert costs.step_share(8) == pytest.approx(0.004 / 8 + 0.0005)
    assert costs.cycle_extra(16) == pytest.approx(15 * 0.0005 + 0.002)
    assert costs.rows == 8


def test_one_kind_of_round_still_prices_its_own_steps_exactly():
    """Only plain rounds of 8 rows seen: the split between a round's fixed cost and its tokens is
    not known, but a plain step's share is the round's eighth, and a verify token is priced like a
    plain row until a cycle's round shows otherwise."""
    costs = RoundCosts()
    _play(costs, [(8, 8, 0, 1)] * 20, lambda tokens, drafting: 0.008)
    assert costs.step_share(8) == pytest.approx(0.001)
    assert costs.cycle_extra(16) == pytest.approx(15 * 0.001, rel=0.05)


def test_a_round_times_the_one_before_only_when_clean_and_of_a_known_shape():
    costs = RoundCosts()
    assert costs.coefficients() is None and costs.step_share(4) is None
    costs.end_round(4, 4, 0, 1, True, 0.0)
    costs.end_round(4, 4, 0, 1, True, 1.0)  # the shape's first round compiled: not a sample
    assert costs.coefficients() is None
    costs.end_round(4, 4, 0, 1, False, 2.0)  # a prefill chunk ran in it: its wall is not the round's
    assert costs.coefficients() is None
    costs.end_round(4, 4, 0, 1, True, 2.5)
    assert costs.step_share(4) == pytest.approx(0.5 / 4, rel=0.01)
    costs.end_round(0, 0, 0, 0, True, 3.0)  # no forwards: nothing to time next
    costs.end_round(4, 4, 0, 1, True, 9.0)
    assert costs.step_share(4) == pytest.approx(0.5 / 4, rel=0.01) and costs.rows == 4
