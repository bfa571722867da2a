"""A reasoning budget (grammar.ReasoningBudget) forces the end of the reasoning block at the same
position in speculative and target-alone decoding: lossless at every acceptance length, alone and
together with a grammar."""

from __future__ import annotations

import pytest
from families import ENGINE_FAMILIES, sample_prompt
from forced import ForcedDrafter
from test_lossless import SCHEDULE

from dflash_core.engine import Engine
from dflash_core.grammar import GrammarSpec
from dflash_core.sampling import SamplingParams

END = 7  # the token standing for the end of reasoning (any id works for the engine)
BUDGET = 40


def _run(engine, prompt, **kwargs):
    chunks = list(engine.generate(prompt, max_tokens=160, stop_token_ids=set(), **kwargs))
    return [t for c in chunks for t in c.token_ids]


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, seed=11)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_the_budget_is_lossless_at_every_acceptance_length(engines, family, sampling):
    engine = engines[family]
    prompt = sample_prompt(engine)
    alone = _run(engine, prompt, speculative=False, sampling=sampling, reasoning_budget=(END, BUDGET))
    assert END in alone[: BUDGET + 1]  # ended by the budget at the latest
    forced = ForcedDrafter(reference=list(prompt) + alone, prompt_length=len(prompt), schedule=SCHEDULE,
                           vocab_size=engine.target.vocab_size, target_layer_ids=engine.drafter.config.target_layer_ids)
    forced_engine = Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16)
    assert _run(forced_engine, prompt, sampling=sampling, reasoning_budget=(END, BUDGET)) == alone
    assert _run(engine, prompt, sampling=sampling, reasoning_budget=(END, BUDGET)) == alone  # its own drafter


def test_the_budget_with_a_grammar(engines):
    """Both masks apply (the forced token must be one the grammar allows there, as a reasoning
    end marker is for the grammars of server/structured.py)."""
    engine = engines["qwen3"]
    prompt = sample_prompt(engine)
    grammar = GrammarSpec("regex", "[a-z ]{0,60}")
    (space,) = engine.tokenizer.encode(" ")
    alone = _run(engine, prompt, speculative=False, grammar=grammar, reasoning_budget=(space, 3))
    assert space in alone[:4]
    assert _run(engine, prompt, grammar=grammar, reasoning_budget=(space, 3)) == alone
