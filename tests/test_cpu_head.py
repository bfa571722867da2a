"""The CPU LM head with float16 weights (dflash_core/kernels/cpu_head.py): the float16 head's product
to float32 rounding, row-invariant to the bit, and speculative output with it exactly the
target-alone output (every acceptance length, greedy and seeded sampling, batched rows)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from families import sample_prompt
from forced import assert_batched_rows_are_as_alone, assert_every_acceptance_length_is_lossless, tokens

from dflash_core.engine import Engine
from dflash_core.kernels import KernelOptions
from dflash_core.kernels.cpu_head import HalfHead, default_threads, library
from dflash_core.loading import load_engine
from dflash_core.sampling import SamplingParams

pytestmark = pytest.mark.skipif(library() is None, reason="not x86-64 Linux with AVX2/FMA/F16C and a C compiler")


@pytest.mark.parametrize("K", [64, 72, 640])  # a multiple of the kernel's 16, one with a tail, the demo's
def test_the_half_head_is_the_float16_weights_product(K):
    rng = np.random.default_rng(0)
    weight = mx.array(rng.standard_normal((1000, K)).astype(np.float32) * 0.05)
    x = mx.array(rng.standard_normal((2, 8, K)).astype(np.float32))
    want = x @ weight.astype(mx.float16).astype(mx.float32).T
    for threads in (1, 2, 3):
        got = HalfHead(weight, library(), threads)(x)
        assert got.shape == (2, 8, 1000) and got.dtype == mx.float32
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    # Not the float32 weights' product: the weights really are float16.
    assert not np.allclose(np.array(got), np.array(x @ weight.T), rtol=1e-6, atol=1e-7)


def test_a_row_gets_the_same_logits_to_the_bit_whatever_rows_share_the_call():
    rng = np.random.default_rng(1)
    weight = mx.array(rng.standard_normal((999, 640)).astype(np.float32))
    rows = mx.array(rng.standard_normal((16, 640)).astype(np.float32))
    together = np.array(HalfHead(weight, library(), 2)(rows))
    for i in range(16):
        for threads in (1, 2):
            alone = np.array(HalfHead(weight, library(), threads)(rows[i : i + 1]))[0]
            assert np.array_equal(alone, together[i])


def _half_head_engine(pair, **kwargs) -> Engine:
    engine = load_engine(str(pair[0]), str(pair[1]), prefill_chunk=16, **kwargs)
    engine.target.cpu_head_min_parameters = 0  # the tiny head takes the kernel too
    assert engine.target._half_head() is not None
    return engine


@pytest.mark.parametrize("pair_name", ["qwen3_pair", "gemma3_pair"])  # a separate head; a tied one
def test_speculation_with_the_half_head_is_lossless(request, pair_name):
    pair = request.getfixturevalue(pair_name)
    engine = _half_head_engine(pair)
    prompt = sample_prompt(engine)
    exact = load_engine(str(pair[0]), str(pair[1]), prefill_chunk=16)
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=7)):
        alone = tokens(engine.generate(prompt, max_tokens=96, sampling=sampling, speculative=False, stop_token_ids=set()))
        spec = tokens(engine.generate(prompt, max_tokens=96, sampling=sampling, speculation="on", stop_token_ids=set()))
        assert spec == alone
    # The logits are the float16 head's, near MLX's float32 head's.
    hidden = mx.random.normal((1, 3, engine.target.hidden_size))
    half, full = engine.target.decode_lm_head(hidden), exact.target.lm_head(hidden)
    assert not np.array_equal(np.array(half), np.array(full))
    np.testing.assert_allclose(np.array(half), np.array(full), rtol=2e-2, atol=2e-2)
    # Every acceptance length 0..15 (16-row verifies against 1-row steps), and rows batched together.
    assert_every_acceptance_length_is_lossless(engine, prompt)
    assert_batched_rows_are_as_alone(engine, prompt, 48)


def test_the_option_and_the_size_keep_mlx_head(qwen3_pair):
    engine = load_engine(str(qwen3_pair[0]), str(qwen3_pair[1]))
    assert engine.target._half_head() is None  # the tiny head is below MIN_PARAMETERS
    off = engine.target.with_kernels(KernelOptions(cpu_half_head=False))
    off.cpu_head_min_parameters = 0
    hidden = mx.random.normal((1, 2, off.hidden_size))
    assert np.array_equal(np.array(off.decode_lm_head(hidden)), np.array(off.lm_head(hidden)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU sets on this platform")
def test_kernels_split_among_the_cores_this_process_may_use():
    """A container's or `taskset`'s CPU set, not the host's core count: more threads than cores
    only take turns."""
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        default_threads.cache_clear()
        assert default_threads() == 1
    finally:
        os.sched_setaffinity(0, allowed)
        default_threads.cache_clear()
    assert default_threads() == max(1, min(len(allowed), 16))
