"""Sampling is lossless: speculation reproduces target-alone sampling exactly, for a seed, and the
sampler draws from the target's processed distribution."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from forced import ForcedDrafter

from dflash_core.engine import Engine
from dflash_core.loading import load_engine
from dflash_core.sampling import Sampler, SamplingError, SamplingParams

PARAMS = [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.02, seed=2),
    SamplingParams(temperature=1.3, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, seed=3),
    SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={7: 5.0, 9: -100.0}),
]


@pytest.fixture(scope="module")
def engine(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    return load_engine(str(target), str(drafter))


def _tokens(engine, prompt, n, **kwargs):
    return [t for c in engine.generate(prompt, max_tokens=n, stop_token_ids=set(), **kwargs) for t in c.token_ids]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "top-p-k-min-p", "penalties", "greedy-bias-penalties"])
def test_speculative_sampling_reproduces_target_alone(engine, params):
    prompt = engine.tokenizer.encode("Once upon a time")
    alone = _tokens(engine, prompt, 80 + 16, speculative=False, sampling=params)
    # Forced drafts along the target's own sampled path: long acceptances under sampling too.
    forced = ForcedDrafter(list(prompt) + alone, len(prompt), [15, 3, 0, 9], engine.target.vocab_size,
                           engine.drafter.config.target_layer_ids)
    for drafter in (engine.drafter, forced):
        spec = Engine(engine.target, engine.tokenizer, drafter)
        chunks = list(spec.generate(prompt, max_tokens=80, stop_token_ids=set(), sampling=params))
        assert [t for c in chunks for t in c.token_ids] == alone[:80]
        assert chunks[-1].stats.speculative
    if params.logit_bias:
        assert 9 not in alone


def test_seed_changes_samples(engine):
    prompt = engine.tokenizer.encode("Once upon a time")
    a = _tokens(engine, prompt, 20, sampling=SamplingParams(temperature=1.0, seed=1))
    b = _tokens(engine, prompt, 20, sampling=SamplingParams(temperature=1.0, seed=2))
    assert a != b


def _chi_square_p(observed: np.ndarray, expected: np.ndarray, dof: int | None = None) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty), bins with expectation < 5 pooled."""
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    k = dof if dof is not None else len(obs) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampler_draws_from_the_processed_distribution():
    # A tiny vocabulary; fixed seeds make the test deterministic, the size makes it meaningful.
    logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, 0.2, -0.3]])
    params = SamplingParams(temperature=0.8, top_k=6, seed=0)
    counts = np.zeros(8)
    n = 4000
    for seed in range(n):
        sampler = Sampler(SamplingParams(temperature=0.8, top_k=6, seed=seed), vocab_size=8)
        counts[sampler.choose(logits, None, 0).item()] += 1
    scaled = np.array(logits[0]) / params.temperature
    kept = scaled >= np.sort(scaled)[-6]
    probs = np.where(kept, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    assert counts[~kept].sum() == 0
    assert _chi_square_p(counts, probs * n) > 1e-3


def test_noise_never_lets_an_unlikely_token_win_on_a_large_vocabulary():
    # Every token of a 262k vocabulary (Gemma's) at 512 generated positions: 134M noise draws, where
    # one noise of +inf in a row would let its token win against a lead of 60 logits (e^-60: never).
    vocab, rows = 262144, 128
    logits = mx.zeros((rows, vocab)).at[:, 1234].add(60.0)
    for first in range(0, 512, rows):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=first), vocab_size=vocab)
        noise = sampler._gumbel(first, rows)
        assert mx.all(mx.isfinite(noise)).item()
        assert mx.all(sampler.choose(logits, None, first) == 1234).item()
        # A grammar's mask: an infinite noise on a masked (-inf) token made NaN, which argmax takes.
        allowed = mx.zeros((rows, vocab), mx.bool_).at[:, 99].add(True)
        assert mx.all(sampler.choose(logits, None, first, allowed) == 99).item()


def test_speculative_distribution_matches_target_alone(engine):
    """Two independent samples, one with speculation (seeds 0..n-1) and one without (seeds n..2n-1),
    of the first three tokens under top-k 2 (a tiny effective vocabulary). The drafter proposes one
    fixed token everywhere, so drafts are sometimes accepted and sometimes rejected at random."""
    prompt = engine.tokenizer.encode("Hello")
    greedy = _tokens(engine, prompt, 2, speculative=False)
    constant = list(prompt) + [greedy[1]] * 40
    n = 300
    spec_counts, alone_counts = {}, {}
    accepted = 0
    for seed in range(n):
        params = SamplingParams(temperature=1.0, top_k=2, seed=seed)
        forced = ForcedDrafter(constant, len(prompt), [15], engine.target.vocab_size,
                               engine.drafter.config.target_layer_ids)
        chunks = list(Engine(engine.target, engine.tokenizer, forced).generate(
            prompt, max_tokens=3, stop_token_ids=set(), sampling=params))
        spec = tuple(t for c in chunks for t in c.token_ids)
        accepted += chunks[-1].stats.draft_tokens_accepted
        alone = tuple(_tokens(engine, prompt, 3, speculative=False,
                              sampling=SamplingParams(temperature=1.0, top_k=2, seed=seed + n)))
        spec_counts[spec] = spec_counts.get(spec, 0) + 1
        alone_counts[alone] = alone_counts.get(alone, 0) + 1
    assert 0 < accepted < n * 2  # both branches of the acceptance rule were taken
    keys = sorted(set(spec_counts) | set(alone_counts))
    a = np.array([alone_counts.get(k, 0) for k in keys], float)
    b = np.array([spec_counts.get(k, 0) for k in keys], float)
    # Two-sample test as a 2 x cells contingency table; only well-filled cells.
    keep = (a + b) >= 10
    a, b = np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())
    pooled = (a + b) / (2 * n)
    cells = int((pooled > 0).sum())
    assert cells >= 3
    p = _chi_square_p(np.concatenate([a, b]), np.concatenate([pooled * n, pooled * n]), dof=cells - 1)
    assert p > 1e-3


@pytest.mark.parametrize(
    "params, param",
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(min_p=2), "min_p"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (SamplingParams(presence_penalty=3), "presence_penalty"),
        (SamplingParams(frequency_penalty=-3), "frequency_penalty"),
        (SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={1: 500.0}), "logit_bias"),
    ],
)
def test_invalid_parameters_are_refused(params, param):
    with pytest.raises(SamplingError) as err:
        params.validate(vocab_size=100)
    assert err.value.param == param


def test_only_greedy_rows_take_the_batch_argmax():
    """`engine.choose`: a batched forward's one argmax (`TargetOutput.choices`) stands for the
    sampler only where greedy decoding applies nothing to the logits first but the bias the argmax
    was taken after; another bias, a penalty, a grammar's mask or a temperature goes through the
    sampler, whose choice then differs here."""
    from dflash_core.adapters import TargetOutput
    from dflash_core.engine import choose

    vocab = 8
    logits = mx.array([[[0.9, 5, 1, 0, 0, 0, 0, 0], [0.9, 1, 5, 0, 0, 0, 0, 0]]])
    out = TargetOutput(logits, None, None, mx.argmax(logits[0], axis=-1).astype(mx.int32))
    drafts = mx.array([2], dtype=mx.int32)
    assert choose(Sampler(SamplingParams(), vocab), out, drafts, 0) is out.choices
    assert choose(Sampler(SamplingParams(logit_bias={3: 10.0}), vocab), out, drafts, 0).tolist() == [3, 3]
    assert choose(Sampler(SamplingParams(repetition_penalty=10.0), vocab, [1, 2]), out, drafts, 0).tolist() == [0, 0]
    no_2 = mx.array([[True] * vocab, [True, True, False] + [True] * 5])
    assert choose(Sampler(SamplingParams(), vocab), out, drafts, 0, no_2).tolist() == [1, 1]
    assert choose(Sampler(SamplingParams(temperature=1.0, seed=1), vocab), out, drafts, 0) is not out.choices
    biased = Sampler(SamplingParams(logit_bias={3: 10.0}), vocab)
    taken_after = TargetOutput(logits, None, None, mx.array([3, 3], dtype=mx.int32), biased.batch_bias)
    assert choose(biased, taken_after, drafts, 0) is taken_after.choices
    other = Sampler(SamplingParams(logit_bias={3: 10.0}), vocab)  # an equal bias, but not this row's
    assert choose(other, taken_after, drafts, 0) is not taken_after.choices
    assert choose(Sampler(SamplingParams(), vocab), taken_after, drafts, 0).tolist() == [1, 2]
    # Without a batch's argmax (a forward alone), every row goes through the sampler.
    alone = TargetOutput(logits, None, None)
    assert choose(Sampler(SamplingParams(), vocab), alone, drafts, 0).tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_batch_argmax_after_each_rows_bias_is_each_rows_own_choice(dtype):
    """`batch_choices`: rows with and without a logit bias, of one and of several positions, in one
    reduction give exactly what each row's own greedy sampler chooses from its logits (a bias
    pushing a token to the top, one pulling the top token down, ties, a key given twice)."""
    from dflash_core.adapters import ForwardRow
    from dflash_core.adapters.base import batch_choices

    vocab, rng = 64, np.random.default_rng(0)
    biases = [None, {5: 30.0}, None, {"7": -2.5, 7: 1.25, 9: 100.0}, {0: -100.0}]
    lengths = [1, 16, 3, 1, 16]
    logits = mx.array(rng.normal(size=(1, sum(lengths), vocab)).round(1)).astype(dtype)  # (ties)
    samplers = [Sampler(SamplingParams(logit_bias=b), vocab) for b in biases]
    rows = [ForwardRow(mx.zeros((1, n), dtype=mx.int32), [], logit_bias=s.batch_bias) for n, s in zip(lengths, samplers)]
    bounds = list(zip(np.cumsum([0] + lengths[:-1]).tolist(), np.cumsum(lengths).tolist()))
    together = batch_choices(logits, rows, bounds).tolist()
    for (s, e), sampler in zip(bounds, samplers):
        assert together[s:e] == sampler.choose(logits[0, s:e], None, 0).tolist()
    assert together[bounds[1][0]:bounds[1][1]] == [5] * 16 and together[bounds[3][0]] == 9


def test_a_bias_entries_are_the_dense_bias_entries():
    """`Sampler.batch_bias` finds its values on the host where every id is given once (reading them
    back would wait for the forwards queued before the generation started): each is what the dense
    float32 add left at its id, rounding included, ids sorted; an id under two spellings is read
    back, summed as the dense add sums it."""
    vocab = 64
    for bias in ({9: 0.1, 3: -2.5e-8, 40: 100.0, 0: -1 / 3}, {"7": 0.1, 7: 0.2, 2: 1.0}):
        sampler = Sampler(SamplingParams(logit_bias=bias), vocab)
        ids, values = sampler.batch_bias
        assert ids == sorted({int(t) for t in bias})
        assert values == sampler._bias[mx.array(ids)].tolist()
