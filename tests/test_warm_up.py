"""The warm-up at load: every width auto verifies, catch-ups of each row variant, the target alone
and a batch, run on an engine of its own so that the model's state is untouched."""

from __future__ import annotations

import logging

import pytest
from families import ENGINE_FAMILIES
from families import sample_prompt as _prompt

from dflash_core.loading import load_engine
from dflash_core.prefix_cache import PrefixCache
from dflash_core.sampling import SamplingParams
from dflash_core.warm_up import CATCH_UPS, FixedPlans, warm_up, warm_up_plans


def test_the_plans_meet_every_width_twice_and_each_catch_up():
    plans = warm_up_plans(16)
    for width in (16, 8, 4, 2):
        assert any(a == b == width for a, b in zip(plans, plans[1:])), width  # a cycle after a cycle of its width
    runs, steps = [], 0
    for width in plans:
        if width == 0:
            steps += 1
        elif steps:
            runs.append(steps)
            steps = 0
    assert runs == list(CATCH_UPS)
    assert set(warm_up_plans(4)) == {0, 4, 2}  # a smaller block: only the widths it has


def test_fixed_plans_then_plain_steps():
    policy = FixedPlans([16, 0, 4])
    assert [policy.plan(100) for _ in range(5)] == [16, 0, 4, 0, 0]


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_warm_up_leaves_the_model_as_it_was(request, family):
    """Every family runs the whole warm-up; the model's prefix cache and what auto measured stay
    empty, and its outputs after are the target-alone outputs."""
    target, drafter = request.getfixturevalue(f"{family}_pair")
    engine = load_engine(str(target), str(drafter), prefill_chunk=16, prefix_cache=10**9, speculation="auto")
    assert isinstance(engine.prefix_cache, PrefixCache)
    assert warm_up(engine) > 0
    assert not engine.prefix_cache.snapshots
    assert not engine.speculation_state.timings.samples
    assert not any(engine.speculation_state.prior.verified)
    prompt = _prompt(engine)
    alone = [t for c in engine.generate(prompt, max_tokens=24, speculative=False, stop_token_ids=set()) for t in c.token_ids]
    auto = [t for c in engine.generate(prompt, max_tokens=24, stop_token_ids=set(), sampling=SamplingParams())
            for t in c.token_ids]
    assert auto == alone


def test_load_warms_up_when_told_and_not_on_the_cpu_by_default(qwen3_pair, caplog):
    target, drafter = qwen3_pair
    with caplog.at_level(logging.INFO, logger="dflash_core.loading"):
        load_engine(str(target), str(drafter), prefill_chunk=16)
        assert "warmed up" not in caplog.text
        load_engine(str(target), str(drafter), prefill_chunk=16, warm_up=True)
        assert "warmed up" in caplog.text
