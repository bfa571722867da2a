"""Log-probabilities are lossless too: speculative decoding reports, for every token, the values
target-alone decoding reports (the verify row that chose a token is the target's own distribution
at its position), greedy and sampled, for every family and every acceptance length 0..15. The
values are log_softmax of the target's raw logits, whatever the sampling parameters."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import ENGINE_FAMILIES
from families import sample_prompt as _prompt
from forced import ForcedDrafter

from dflash_core.engine import Engine, RequestError
from dflash_core.sampling import SamplingParams

MODES = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, seed=11)}
N_TOKENS = 256  # room for every acceptance length of the forced schedule
N_REAL = 48  # the random drafters accept almost nothing: every token is a cycle
K = 5
# As tests/test_lossless.py: every acceptance length 0..15, short and long ones side by side.
SCHEDULE = [15, 0, 7, 1, 14, 2, 13, 3, 12, 4, 11, 5, 10, 6, 9, 8, 15, 15, 0, 0]


def _run(engine: Engine, prompt, max_tokens, **kwargs):
    kwargs.setdefault("stop_token_ids", set())
    chunks = list(engine.generate(prompt, max_tokens=max_tokens, **kwargs))
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs] if kwargs.get("logprobs") is not None else None
    for c in chunks:  # aligned chunk by chunk, or absent when off
        assert (c.logprobs is None) == (kwargs.get("logprobs") is None)
        assert c.logprobs is None or [lp.token for lp in c.logprobs] == c.token_ids
    return tokens, logprobs, chunks[-1]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token == y.token
        assert abs(x.logprob - y.logprob) <= 1e-5
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        assert np.allclose([v for _, v in x.top], [v for _, v in y.top], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def references(engines):
    out = {}
    for family, engine in engines.items():
        prompt = _prompt(engine)
        for mode, params in MODES.items():
            tokens, logprobs, last = _run(engine, prompt, N_TOKENS + 16, speculative=False, sampling=params, logprobs=K)
            assert len(tokens) == len(logprobs) == N_TOKENS + 16 and not last.stats.speculative
            out[family, mode] = (prompt, tokens, logprobs)
    return out


def _forced_engine(engine: Engine, prompt, reference, schedule=SCHEDULE) -> Engine:
    forced = ForcedDrafter(list(prompt) + reference, len(prompt), schedule, engine.target.vocab_size,
                           engine.drafter.config.target_layer_ids)
    return Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_speculative_logprobs_equal_target_alone(engines, references, family, mode):
    engine, params = engines[family], MODES[mode]
    prompt, reference, expected = references[family, mode]
    tokens, logprobs, last = _run(engine, prompt, N_REAL, sampling=params, logprobs=K)
    assert last.stats.speculative and last.stats.cycles > 0
    assert tokens == reference[:N_REAL]
    _assert_same(logprobs, expected[:N_REAL])
    # Every acceptance length 0..15: token j of a cycle's commit is read from verify row j.
    tokens, logprobs, last = _run(_forced_engine(engine, prompt, reference), prompt, N_TOKENS, sampling=params, logprobs=K)
    assert tokens == reference[:N_TOKENS]
    _assert_same(logprobs, expected[:N_TOKENS])
    per_cycle = [SCHEDULE[i % len(SCHEDULE)] for i in range(last.stats.cycles)]
    assert set(per_cycle) == set(range(16))


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_values_are_the_raw_distribution(engines, references, family):
    engine = engines[family]
    prompt, greedy, greedy_logprobs = references[family, "greedy"]
    _, sampled, sampled_logprobs = references[family, "sampled"]
    # The first token's values are log_softmax of the target's own logits for the prompt.
    cache = engine.target.make_cache(max_rollback=16)
    logits = engine.target.forward(mx.array(prompt)[None], cache, last_logits_only=True).logits[0, -1]
    x = np.array(logits.astype(mx.float32), dtype=np.float64)
    expected = x - x.max() - np.log(np.exp(x - x.max()).sum())
    top = sorted(range(len(x)), key=lambda i: (-expected[i], i))[:K]
    first = greedy_logprobs[0]
    assert [i for i, _ in first.top] == top
    assert np.allclose([v for _, v in first.top], expected[top], atol=1e-5)
    assert abs(first.logprob - expected[greedy[0]]) <= 1e-5
    # Sampling parameters, logit_bias included, do not change them.
    biased = SamplingParams(temperature=0.8, seed=11, top_k=3, logit_bias={top[-1]: 50.0})
    tokens, logprobs, _ = _run(engine, prompt, 1, speculative=False, sampling=biased, logprobs=K)
    assert tokens == [top[-1]]
    assert logprobs[0].top == first.top and abs(logprobs[0].logprob - expected[top[-1]]) <= 1e-5
    assert sampled_logprobs[0].top == first.top
    for lp in greedy_logprobs:  # greedy picks the top-1, and the top is sorted
        assert (lp.token, lp.logprob) == lp.top[0]
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    for lp in sampled_logprobs:
        assert lp.logprob <= lp.top[0][1] <= 0.0
        assert lp.token not in [i for i, _ in lp.top] or (lp.token, lp.logprob) in lp.top


@pytest.mark.parametrize("speculative", [False, True])
def test_k_zero_off_and_bad_values(engines, speculative):
    engine = engines["qwen3"]
    prompt = _prompt(engine)
    tokens, logprobs, _ = _run(engine, prompt, 20, speculative=speculative, logprobs=0)
    assert len(logprobs) == len(tokens) == 20 and all(lp.top == [] and lp.logprob <= 0.0 for lp in logprobs)
    tokens_off, _, last = _run(engine, prompt, 20, speculative=speculative)  # None: asserted per chunk
    assert tokens_off == tokens and last.logprobs is None
    for bad in (-1, 21, True):
        with pytest.raises(RequestError, match="logprobs"):
            engine.generate(prompt, max_tokens=4, logprobs=bad)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_cuts_by_budget_and_stop_token_cut_logprobs_alike(engines, references, family):
    """Logprobs of tokens a max_tokens or stop-token cut removes from a block are removed with them."""
    engine = engines[family]
    prompt, reference, expected = references[family, "greedy"]
    forced = _forced_engine(engine, prompt, reference, schedule=[15])
    tokens, logprobs, last = _run(forced, prompt, 21, logprobs=K)  # inside the second full cycle
    assert tokens == reference[:21] and last.finish_reason == "length"
    _assert_same(logprobs, expected[:21])
    stop = reference[9]
    first = reference.index(stop)
    tokens, logprobs, last = _run(forced, prompt, 200, logprobs=K, stop_token_ids={stop})
    assert tokens == reference[:first] and last.finish_reason == "stop" and last.stop_token_id == stop
    _assert_same(logprobs, expected[:first])
