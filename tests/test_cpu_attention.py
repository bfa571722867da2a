"""Attention on the CPU in our primitives (dflash_core/kernels/cpu_softmax.cpp, cpu_attention.cpp)
and the path around them (kernels/attention.py: `unfused_cpu`, `single_query`): close to MLX's
softmax, products and fused attention, exact zeros for masked scores, a row's bits independent of
masked keys wherever they sit and of the rows beside it, MLX's gradients, and a 16-token verify
giving every family's tokens the logits 16 one-token steps give them, to the bit (the test_lossless
suites run on this path; tests/test_blas.py runs them with MKL)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import ENGINE_FAMILIES, sample_prompt
from forced import assert_verify_is_single_steps

from dflash_core.kernels import KernelOptions, backend
from dflash_core.kernels import attention as attn
from dflash_core.loading import load_engine

LOWEST = float(np.finfo(np.float32).min)  # what MLX's masking writes over a masked score

pytestmark = pytest.mark.skipif(backend() != "cpu", reason="the path of MLX's CPU backend")


@pytest.fixture(scope="module", autouse=True)
def module(cpu_kernels):
    return cpu_kernels


def _scores(shape, seed=0, scale=4.0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


def test_softmax_is_mlx_within_rounding_with_exact_zeros_and_mask_blind_rows(module):
    x = _scores((3, 5, 300))
    masked = mx.where(mx.arange(300) < 230, x, LOWEST)
    got = module.softmax(masked, 2)
    np.testing.assert_allclose(np.array(got), np.array(mx.softmax(masked, axis=-1, precise=True)), rtol=2e-5,
                               atol=1e-9)
    assert (np.array(got)[..., 230:] == 0).all()  # exactly zero, as a masked key must weigh
    np.testing.assert_allclose(np.array(got).sum(-1), 1.0, rtol=1e-5)
    # A query's keys alone (decode) or in a longer buffer with the tail masked (verify): same bits,
    # at every length around the vectors' 8 lanes.
    for n in (1, 5, 7, 8, 9, 16, 17, 229):
        alone = module.softmax(x[..., :n], 1)
        padded = mx.concatenate([x[..., :n], mx.full(x[..., :13].shape, LOWEST)], axis=-1)
        assert mx.array_equal(module.softmax(padded, 2)[..., :n], alone)
    # Masked scores between a row's own (a batched row's padding between its context and its
    # block) change nothing either.
    for at, gap in ((3, 5), (8, 8), (100, 13)):
        row = x[..., :150]
        gapped = mx.concatenate([row[..., :at], mx.full(row[..., :gap].shape, LOWEST), row[..., at:]], axis=-1)
        probs = module.softmax(gapped, 1)
        assert mx.array_equal(mx.concatenate([probs[..., :at], probs[..., at + gap :]], axis=-1), module.softmax(row, 1))
    # A row's bits do not depend on the other rows of the call (nor on the threads splitting them).
    many = _scores((64, 16, 300), seed=1)
    together = module.softmax(many, 2)
    for i in (0, 17, 63):
        assert mx.array_equal(module.softmax(many[i : i + 1, 3:4], 1)[0, 0], together[i, 3])
    # A NaN score, or a row of -inf only, gives NaN throughout, as MLX's softmax does.
    odd = mx.array([[0.0, float("nan")] + [1.0] * 20, [-float("inf")] * 22, [1.0] * 21 + [float("nan")]])
    assert np.isnan(np.array(module.softmax(odd, 1))).all()
    assert np.isnan(np.array(mx.softmax(odd, axis=-1, precise=True))).all()
    # Far below the row's maximum the exp is 0; no NaN from MLX's lowest float.
    extreme = mx.array([[0.0, -87.0, -88.0, -1e30, LOWEST]])
    probs = np.array(module.softmax(extreme, 1))[0]
    assert probs[0] > 0.99 and probs[1] > 0 and (probs[2:] == 0).all()


def test_softmax_has_mlx_gradient(module):
    x = _scores((4, 37), seed=2)
    weights = _scores((4, 37), seed=3)
    got = mx.grad(lambda x: (module.softmax(x, 1) * weights).sum())(x)
    expected = mx.grad(lambda x: (mx.softmax(x, axis=-1, precise=True) * weights).sum())(x)
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-6)


def test_attention_products_are_mlx_within_rounding_and_fixed_order(module):
    """cpu_attention.cpp: q·kᵀ and p·v close to MLX's products, a row's bits independent of the other
    rows, of the threads and of the keys after it; masked keys (zero weights) anywhere, with any
    finite value behind them, change no bit; strided views (a cache's buffer) read in place."""
    rng = np.random.default_rng(5)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    for D in (64, 72, 256):  # 72: a tail past the vectors' 8 lanes
        q, k = normal(2, 3, 21, D), normal(2, 3, 301, D)
        scores = module.attention_scores(q, k, 2)
        np.testing.assert_allclose(np.array(scores), np.array(q @ k.swapaxes(-1, -2)), rtol=1e-4, atol=1e-4)
        assert mx.array_equal(module.attention_scores(q[:, :, 5:6], k[:, :, :40], 1), scores[:, :, 5:6, :40])
        p, v = mx.softmax(normal(2, 3, 21, 301), axis=-1), normal(2, 3, 301, D)
        out = module.attention_values(p, v, 2)
        np.testing.assert_allclose(np.array(out), np.array(p @ v), rtol=1e-4, atol=1e-5)
        assert mx.array_equal(module.attention_values(p[:, :, 7:8], v, 1), out[:, :, 7:8])
        # Keys past a query's own with weight 0 (a cache's masked tail, stale values behind it),
        # and a masked gap inside (a batched row's padding): the sum over its keys alone, same bits.
        alone = module.attention_values(p[:, :, :, :200], v[:, :, :200], 1)
        tail = mx.concatenate([p[:, :, :, :200], mx.zeros_like(p[:, :, :, 200:])], axis=-1)
        stale = mx.concatenate([v[:, :, :200], v[:, :, 200:] * 1e30], axis=2)
        assert mx.array_equal(module.attention_values(tail, stale, 2), alone)
        gap = mx.concatenate([p[:, :, :, :50], mx.zeros_like(p[:, :, :, :70]), p[:, :, :, 50:200]], axis=-1)
        gapped_v = mx.concatenate([v[:, :, :50], normal(2, 3, 70, D) * 1e30, v[:, :, 50:200]], axis=2)
        assert mx.array_equal(module.attention_values(gap, gapped_v, 2), alone)
        # A KV cache's keys and values: views of a longer buffer, and a broadcast batch.
        buffer_k, buffer_v = normal(2, 3, 512, D), normal(2, 3, 512, D)
        assert mx.array_equal(module.attention_scores(q, buffer_k[:, :, :301], 2),
                              module.attention_scores(q, mx.array(np.array(buffer_k[:, :, :301])), 2))
        assert mx.array_equal(module.attention_values(p, buffer_v[:, :, :301], 2),
                              module.attention_values(p, mx.array(np.array(buffer_v[:, :, :301])), 2))
        one = mx.broadcast_to(k[:1], k.shape)
        assert mx.array_equal(module.attention_scores(q, one, 2)[1], module.attention_scores(q[1:], k[:1], 2)[0])
    # A last axis that is not contiguous is copied first, in the product's task: here of an input
    # computed in the same graph (evaluated before anything else reads it).
    kt = (normal(2, 3, 64, 301) * 2.0).swapaxes(-1, -2)
    got = module.attention_scores(q[..., :64], kt, 2)
    mx.eval(got)
    assert mx.array_equal(got, module.attention_scores(q[..., :64], mx.array(np.array(kt)), 2))


def test_attention_products_have_mlx_gradients(module):
    rng = np.random.default_rng(6)
    q, k, p, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in
                  ((2, 5, 16), (2, 9, 16), (2, 5, 9), (2, 9, 16)))
    for ours, mlx, a, b in ((module.attention_scores, lambda a, b: a @ b.swapaxes(-1, -2), q, k),
                            (module.attention_values, lambda a, b: a @ b, p, v)):
        weights = mx.array(rng.standard_normal(mlx(a, b).shape).astype(np.float32))
        got = mx.grad(lambda a, b: (ours(a, b, 1) * weights).sum(), argnums=(0, 1))(a, b)
        expected = mx.grad(lambda a, b: (mlx(a, b) * weights).sum(), argnums=(0, 1))(a, b)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(np.array(g), np.array(e), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (4, 1)])
def test_cpu_attention_is_mlx_fused_attention(heads, kv_heads):
    B, L, T, D = 2, 16, 300, 64
    rng = np.random.default_rng(4)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in
               ((B, heads, L, D), (B, kv_heads, T, D), (B, kv_heads, T, D)))
    start = 250
    boolean = mx.arange(T)[None] <= mx.arange(start, start + L)[:, None]
    for mask in (boolean, mx.broadcast_to(boolean, (B, 1, L, T)), mx.broadcast_to(boolean, (B, heads, L, T)),
                 mx.where(boolean, 0.0, -1e9), None):
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
        got = attn.unfused_cpu(q, k, v, D**-0.5, mask)
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-5)
    # Decode (one query over the keys it has) gives a block's query the same bits.
    block = attn.attention(q, [k], [v], D**-0.5, boolean)
    for i in (0, 5, 15):
        alone = attn.single_query(q[:, :, i : i + 1], k[:, :, : start + i + 1], v[:, :, : start + i + 1], None,
                                  D**-0.5, "causal")
        assert mx.array_equal(alone[:, :, 0], block[:, :, i])


def test_gate():
    q = mx.zeros((1, 8, 16, 64))
    mask = mx.ones((16, 64), mx.bool_)
    assert attn.path_for(q, mask) == "cpu"
    assert attn.path_for(q[:, :, :1], None) == "cpu"  # decode takes it too
    assert attn.path_for(q, mask, KernelOptions(cpu_softmax=False)) == "fused"
    assert attn.path_for(q.astype(mx.bfloat16), mask) != "cpu"  # float32 only
    assert attn.path_for(q, "causal") != "cpu"  # a prefill's causal mask: MLX's own


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_a_verify_gives_its_tokens_the_logits_of_single_steps(request, family):
    """Every family's 16-token verify (through our softmax) and 16 one-token steps give each token
    the same logits to the bit, contexts past Gemma's sliding windows included."""
    target_dir, drafter_dir = request.getfixturevalue(f"{family}_pair")
    engine = load_engine(str(target_dir), str(drafter_dir), prefill_chunk=16)
    target = engine.target
    assert attn.path_for(mx.zeros((1, 2, 16, 8)), mx.ones((16, 8), mx.bool_), target.kernels) == "cpu"
    prompt = (sample_prompt(engine) * 8)[:100]
    assert_verify_is_single_steps(target, prompt, prompt[:16])


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_prefill_attends_through_our_softmax_within_rounding_of_mlx(request, family, monkeypatch):
    """Qwen3's and Gemma 3's prefill chunks (mlx-lm's layers) attend through our softmax on the CPU
    (`adapters/dense.py: prefill_attention`), within float32 rounding of MLX's own attention."""
    from dflash_core.adapters import dense

    calls = []
    real = dense.unfused_cpu
    monkeypatch.setattr(dense, "unfused_cpu", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    target_dir, drafter_dir = request.getfixturevalue(f"{family}_pair")
    target = load_engine(str(target_dir), str(drafter_dir)).target
    prompt = mx.array([(list(range(3, 40)) * 3)[:100]])
    ours = target.forward(prompt, target.make_cache(16)).logits
    assert 100 in calls  # the 100-token chunk took it
    mlx = target.with_kernels(KernelOptions(cpu_softmax=False)).forward(prompt, target.make_cache(16)).logits
    np.testing.assert_allclose(np.array(ours), np.array(mlx), rtol=1e-4, atol=1e-4)
