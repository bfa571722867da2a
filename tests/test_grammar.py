"""Grammar-constrained decoding is lossless: constrained speculative output equals constrained
target-alone output token for token, greedy and sampled, for every family and every acceptance
length 0..15, and the output matches the grammar. Drafts the grammar forbids (including ones the
unconstrained target would have chosen) end acceptance exactly where they stand."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from families import ENGINE_FAMILIES
from families import sample_prompt as _prompt
from forced import ForcedDrafter

from dflash_core.engine import Engine, RequestError
from dflash_core.grammar import (
    Constraint,
    GrammarError,
    GrammarSpec,
    compile_grammar,
    tokenizer_info,
)
from dflash_core.prompts import hf_tokenizer
from dflash_core.sampling import Sampler, SamplingParams

MODES = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, seed=5)}
# As tests/test_lossless.py: every acceptance length 0..15, short and long ones side by side.
SCHEDULE = [15, 0, 7, 1, 14, 2, 13, 3, 12, 4, 11, 5, 10, 6, 9, 8, 15, 15, 0, 0]
N_TOKENS = 256

# No whitespace between tokens: random models would otherwise pad JSON with whitespace forever.
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
    **COMPACT,
}
# At least 140 numbers: longer than N_TOKENS, so the forced drafts run a whole schedule.
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 140, **COMPACT}
WORDS = r"[a-z ]{5,80}\."
GRAMMARS = {
    "json_object": GrammarSpec("json_object"),
    "json_schema": GrammarSpec("json_schema", PERSON),
    "regex": GrammarSpec("regex", WORDS),
}


def _run(engine: Engine, prompt, max_tokens, **kwargs):
    chunks = list(engine.generate(prompt, max_tokens=max_tokens, **kwargs))
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
    return tokens, "".join(c.text for c in chunks), chunks[-1], logprobs


def _assert_valid(kind: str, engine: Engine, tokens, text: str, last):
    if last.finish_reason == "length":  # cut short: what there is must still be a valid prefix
        constraint = Constraint(compile_grammar(GRAMMARS[kind], engine.grammar_tokenizer), engine.target.vocab_size, ())
        assert constraint.matcher.validate_tokens(tokens) == len(tokens)
        return
    assert last.finish_reason == "stop"
    if kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "age", "color"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert type(value["age"]) is int and 0 <= value["age"] <= 150
        assert value["color"] in ("red", "green", "blue")
    else:
        assert re.fullmatch(WORDS, text)


@pytest.mark.parametrize("kind", GRAMMARS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_constrained_speculative_equals_target_alone(engines, family, mode, kind):
    engine, prompt = engines[family], _prompt(engines[family])
    # Any JSON object may run on (whitespace, long strings): a budget that keeps the test short.
    max_tokens = 64 if kind == "json_object" else 200
    kwargs = dict(max_tokens=max_tokens, sampling=MODES[mode], grammar=GRAMMARS[kind])
    alone, text, last, _ = _run(engine, prompt, speculative=False, **kwargs)
    spec, spec_text, spec_last, _ = _run(engine, prompt, **kwargs)
    assert spec_last.stats.speculative and spec_last.stats.cycles > 0
    assert spec == alone and spec_text == text
    assert (spec_last.finish_reason, spec_last.stop_token_id) == (last.finish_reason, last.stop_token_id)
    _assert_valid(kind, engine, alone, text, last)
    if kind != "json_object":  # these always complete, and end on one of the model's stop tokens
        assert last.finish_reason == "stop" and last.stop_token_id in engine.eos_token_ids


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_complete_grammar_ends_without_stop_tokens(engines, family, mode):
    """With no stop tokens to end on, the output ends where the grammar is complete."""
    engine, prompt = engines[family], _prompt(engines[family])
    kwargs = dict(sampling=MODES[mode], grammar=GRAMMARS["json_schema"])
    with_stop, _, _, _ = _run(engine, prompt, 200, speculative=False, **kwargs)
    for speculative in (False, True):
        tokens, text, last, _ = _run(engine, prompt, 200, speculative=speculative, stop_token_ids=set(), **kwargs)
        assert tokens == with_stop
        assert (last.finish_reason, last.stop_token_id) == ("stop", None)
        assert last.stats.generated_tokens == len(tokens)
        _assert_valid("json_schema", engine, tokens, text, last)


@dataclass
class ForbiddenDrafter(ForcedDrafter):
    """ForcedDrafter whose planted error is a token the grammar forbids there."""

    plants: dict[int, int] = field(default_factory=dict)  # position in `reference` -> a forbidden token

    def propose(self, bonus, target, cache, width=None):
        accept = self.schedule[cache[0].cycles % len(self.schedule)]
        position = cache[0].offset + accept + 1
        drafts = super().propose(bonus, target, cache, width).tolist()
        if accept < len(drafts) and position in self.plants:
            drafts[accept] = self.plants[position]
        return mx.array(drafts, dtype=mx.int32)


def _forbidden_plants(engine: Engine, grammar, prompt, reference, logprobs) -> tuple[dict[int, int], int]:
    """A token the grammar forbids at each position of the reference: the raw model's favourite when
    the grammar forbids it (unmasked verify rows would accept it), else the first forbidden id.
    Also how many are the raw favourite."""
    constraint = Constraint(grammar, engine.target.vocab_size, ())
    plants, favourites = {}, 0
    for i, token in enumerate(reference):
        allowed = np.array(constraint.masks()[0])
        favourite = logprobs[i].top[0][0]
        if not allowed[favourite]:
            plants[len(prompt) + i], favourites = favourite, favourites + 1
        else:
            plants[len(prompt) + i] = int(np.flatnonzero(~allowed)[0])
        constraint.commit([token])
    return plants, favourites


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_every_acceptance_length_and_forbidden_drafts(engines, family, mode):
    engine, prompt = engines[family], _prompt(engines[family])
    grammar = compile_grammar(GrammarSpec("json_schema", NUMBERS), engine.grammar_tokenizer)
    kwargs = dict(sampling=MODES[mode], grammar=grammar, stop_token_ids=set())
    reference, _, last, logprobs = _run(engine, prompt, N_TOKENS + 16, speculative=False, logprobs=1, **kwargs)
    assert len(reference) == N_TOKENS + 16 and last.finish_reason == "length"
    plants, favourites = _forbidden_plants(engine, grammar, prompt, reference, logprobs)
    if mode == "greedy":  # the masks really were needed: the raw argmax was planted many times
        assert favourites > 20
    drafter = ForbiddenDrafter(list(prompt) + reference, len(prompt), SCHEDULE, engine.target.vocab_size,
                               engine.drafter.config.target_layer_ids, plants=plants)
    tokens, _, last, _ = _run(Engine(engine.target, engine.tokenizer, drafter, prefill_chunk=16), prompt, N_TOKENS,
                              **kwargs)
    assert tokens == reference[:N_TOKENS]
    # Acceptance ended at each forbidden draft, exactly: the schedule, every length 0..15, happened.
    stats = last.stats
    per_cycle = [SCHEDULE[i % len(SCHEDULE)] for i in range(stats.cycles)]
    assert set(per_cycle) == set(range(16))
    before_last = 1 + sum(a + 1 for a in per_cycle[:-1])
    per_cycle[-1] = min(per_cycle[-1], N_TOKENS - before_last)
    assert stats.draft_tokens_accepted == sum(per_cycle)
    assert stats.accepted_by_position[0] == sum(1 for a in per_cycle if a >= 1)
    assert stats.accepted_by_position[14] == sum(1 for a in per_cycle if a == 15)


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_logprobs_with_a_grammar_stay_raw(engines, family):
    engine, prompt = engines[family], _prompt(engines[family])
    free, _, _, free_logprobs = _run(engine, prompt, 1, speculative=False, logprobs=5)
    for mode, params in MODES.items():
        kwargs = dict(sampling=params, grammar=GRAMMARS["json_schema"], logprobs=5)
        alone, _, _, expected = _run(engine, prompt, 200, speculative=False, **kwargs)
        tokens, _, _, logprobs = _run(engine, prompt, 200, **kwargs)
        assert tokens == alone and [lp.token for lp in logprobs] == tokens
        for x, y in zip(logprobs, expected):
            assert abs(x.logprob - y.logprob) <= 1e-5 and [i for i, _ in x.top] == [i for i, _ in y.top]
        # The first position's distribution is the unconstrained one, though "{" was forced.
        assert expected[0].top == free_logprobs[0].top and tokens[0] != free[0]
        assert expected[0].logprob < expected[0].top[0][1]


def test_invalid_grammars_raise_grammar_error(engines):
    engine = engines["qwen3"]
    prompt = _prompt(engine)
    bad = [
        (GrammarSpec("json_schema", {"type": "strang"}), "strang"),
        (GrammarSpec("json_schema", {"$ref": "#/nowhere"}), "nowhere"),
        (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
        (GrammarSpec("json_schema", [1, 2]), "object"),
        (GrammarSpec("regex", "a(b"), "unclosed group"),
        (GrammarSpec("lark", "start: undefined_rule"), "undefined_rule"),
        (GrammarSpec("regex", ""), "non-empty"),
        (GrammarSpec("yaml", "a: b"), "unknown grammar kind"),
    ]
    for spec, message in bad:
        with pytest.raises(GrammarError, match=message):
            engine.generate(prompt, max_tokens=4, grammar=spec)  # at the call, before any decoding
        with pytest.raises(GrammarError, match=message):
            compile_grammar(spec, engine.grammar_tokenizer)
    assert issubclass(GrammarError, ValueError)
    # A grammar compiled for a smaller vocabulary is refused.
    compiled = compile_grammar(GRAMMARS["regex"], engine.grammar_tokenizer)
    small = replace(compiled, tokenizer=SimpleNamespace(vocab_size=engine.target.vocab_size - 1))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.generate(prompt, max_tokens=4, grammar=small)
    assert engine.generate(prompt, max_tokens=4, grammar=compiled) is not None
    assert engine.grammar_tokenizer is engine.grammar_tokenizer  # built once


def test_lark_grammar(engines):
    engine = engines["gemma3"]
    prompt = _prompt(engine)
    lark = 'start: "answer: " ("yes" | "no") "!"'
    for speculative in (False, True):
        _, text, last, _ = _run(engine, prompt, 50, speculative=speculative, grammar=GrammarSpec("lark", lark),
                                sampling=MODES["sampled"])
        assert text in ("answer: yes!", "answer: no!") and last.finish_reason == "stop"


def test_masks_rows_follow_the_drafts(engines):
    engine = engines["qwen3"]
    tokenizer, vocab = engine.grammar_tokenizer, engine.target.vocab_size
    stop = max(engine.eos_token_ids)
    constraint = Constraint(compile_grammar(GrammarSpec("regex", "ab[0-9]"), tokenizer), vocab, {stop})
    a, b, digit, brace = (engine.tokenizer.encode(s)[0] for s in ("a", "b", "7", "{"))
    first = np.array(constraint.masks())
    assert first.shape == (1, vocab) and first[0, a] and not first[0, b] and not first[0, stop]
    rows = np.array(constraint.masks([a, b, digit]))
    assert rows[1, b] and not rows[1, a] and rows[2, digit] and not rows[2, stop]
    assert rows[3, stop] and rows[3].sum() == 1  # complete: only the stop token
    # A forbidden draft ends the chain; the rows after it allow everything (acceptance ends there).
    rows = np.array(constraint.masks([a, brace, b]))
    assert rows[1, b] and not rows[1, brace] and rows[2:].all()
    assert (np.array(constraint.masks()) == first).all()  # drafts were rolled back
    constraint.commit([a, b, digit, stop, 5])  # what follows a stop token is not the grammar's
    assert constraint.end is None and constraint.consumed == 3
    # This generation's stop tokens replace llguidance's end of sequence, allowed once the grammar is satisfied.
    eos = tokenizer.eos_token
    for stops in ((), {brace}):
        constraint = Constraint(compile_grammar(GrammarSpec("regex", "a+"), tokenizer), vocab, stops)
        rows = np.array(constraint.masks([a]))
        assert not rows[:, eos].any() and not rows[0, brace] and rows[1, brace] == bool(stops) and rows[1, a]
    # Embedding rows beyond the tokenizer are never allowed.
    wide = Constraint(compile_grammar(GrammarSpec("regex", "(.|\n)*"), tokenizer_info(hf_tokenizer(engine.tokenizer), 600)),
                      600, ())
    mask = np.array(wide.masks())
    assert mask.shape == (1, 600) and mask[0, :vocab].any() and not mask[0, vocab:].any()


def test_generations_of_one_compiled_grammar_start_apart(engines):
    """A compiled grammar is compiled once per request and may serve several generations (or
    the next request's retry): each starts from the grammar's start, whatever the others did."""
    engine = engines["qwen3"]
    vocab, stop = engine.target.vocab_size, max(engine.eos_token_ids)
    grammar = compile_grammar(GrammarSpec("regex", "ab[0-9]"), engine.grammar_tokenizer)
    a, b = (engine.tokenizer.encode(s)[0] for s in ("a", "b"))
    first = Constraint(grammar, vocab, {stop})
    start = np.array(first.masks())
    first.commit([a, b])
    second = Constraint(grammar, vocab, {stop})
    assert (np.array(second.masks()) == start).all() and not (np.array(first.masks()) == start).all()
    assert second.consumed == 0 and first.consumed == 2


def test_sampler_draws_only_allowed_tokens():
    vocab = 64
    logits = mx.random.normal((1, vocab), key=mx.random.key(0))
    allowed = mx.array(np.arange(vocab) % 5 == 0)[None]
    ok = set(range(0, vocab, 5))
    greedy = Sampler(SamplingParams(), vocab).choose(logits, None, 0, allowed).item()
    assert greedy == max(ok, key=lambda i: logits[0, i].item())
    params = SamplingParams(temperature=1.5, top_p=0.9, top_k=8, seed=1)
    sampler = Sampler(params, vocab)
    seen = {sampler.choose(logits, None, i, allowed).item() for i in range(200)}
    assert seen <= ok and len(seen) > 1
