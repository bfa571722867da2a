"""The warm-up at load: every width auto verifies, catch-ups of each row variant, the target alone
and a batch, run on an engine of its own so that the model's state is untouched."""

from __future__ import annotations

import logging

import pytest
from families import ENGINE_FAMILIES
from families import sample_prompt as _prompt

from dflash_core.kernels import KernelOptions
from dflash_core.loading import load_engine
from dflash_core.prefix_cache import PrefixCache
from dflash_core.sampling import SamplingParams
from dflash_core.speculation import auto_widths
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
    assert engine.speculation_state.rounds.rows == 0  # no batched round counted on the model
    assert engine.cache_bytes_per_token is None
    # The vocabulary's view for grammars is built now, where the model's requests find it.
    assert engine._grammar_tokenizer is not None
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


class _Proposals:
    """The engine's real drafter, noting the width of each block it drafts alone (after each read:
    it does not draft ahead, so that each block drafted is a cycle run)."""

    drafts_ahead = False

    def __init__(self, drafter):
        self.drafter, self.widths = drafter, []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, bonus, target, cache, width=None):
        self.widths.append(width)
        return self.drafter.propose(bonus, target, cache, width)


def test_every_plan_runs_when_every_draft_is_accepted(qwen3_pair):
    """A cycle can make a whole block of tokens: the warm-up's generations are long enough for all
    of its plans however many drafts are accepted."""
    from dflash_core.engine import Engine
    from dflash_core.random_models import ForcedAcceptance

    target, drafter = qwen3_pair
    engine = load_engine(str(target), str(drafter), prefill_chunk=16)
    drafts = _Proposals(engine.drafter)
    accepting = Engine(ForcedAcceptance(engine.target, [15], 16), engine.tokenizer, drafts, prefill_chunk=16)
    warm_up(accepting)
    cycles = [w for w in warm_up_plans(16) if w]
    # Both prompts; after the first one's batch, a full and a narrow cycle with log-probabilities
    # and with a grammar.
    assert drafts.widths == cycles + [16, 2] * 2 + cycles


@pytest.mark.parametrize("max_context", [64, 24, 23])
def test_a_short_context_runs_what_fits(qwen3_pair, max_context):
    target, drafter = qwen3_pair
    engine = load_engine(str(target), str(drafter), prefill_chunk=16, max_context=max_context)
    drafts = _Proposals(engine.drafter)
    engine.drafter = drafts
    assert warm_up(engine) is not None
    assert len(drafts.widths) < len([w for w in warm_up_plans(16) if w])  # fewer plans, and no error
    assert engine._grammar_tokenizer is not None  # the requests' part ran once, however short the prompts


def test_the_warm_up_drafts_ahead_as_a_server_does(qwen3_pair):
    """A server's cycles draft the next block before the host reads them (engine.py): the warm-up
    runs that path too, for each width it runs twice in a row, and still every plan."""
    target, drafter = qwen3_pair
    engine = load_engine(str(target), str(drafter), prefill_chunk=16)
    assert not engine.drafter.drafts_ahead  # not on a CPU, unless asked for
    engine.drafter = engine.drafter.with_kernels(KernelOptions(draft_ahead=True))
    calls = []
    real = engine.drafter.propose
    engine.drafter.propose = lambda *args, **kwargs: calls.append((args[3], "start" in kwargs)) or real(*args, **kwargs)
    assert warm_up(engine) is not None
    ahead = {width for width, is_ahead in calls if is_ahead}
    assert set(auto_widths(16)) <= ahead
