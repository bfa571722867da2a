"""Every available implementation of each custom kernel against the pure-MLX reference.

On this CPU-only CI the reference is checked against NumPy and the accelerator paths are skipped;
the GPU benchmark run executes this file on the device too (see docs/performance.md).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_core.kernels import KernelOptions, backend
from dflash_core.kernels import gated_delta as gd

SHAPES = [  # B, T, Hk, Hv, Dk, Dv
    (1, 1, 2, 4, 32, 16),
    (1, 16, 2, 4, 64, 32),
    (1, 16, 16, 32, 128, 128),
    (2, 300, 2, 2, 128, 64),
]


def _inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)) / Dk**0.5
    k = mx.random.normal((B, T, Hk, Dk)) / Dk**0.5
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.exp(-mx.random.uniform(0.0, 0.5, (B, T, Hv)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype), state


def _numpy(q, k, v, g, beta, state):
    q, k, v, g, beta, s = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v, g, beta, state))
    B, T, Hk, _ = q.shape
    Hv = v.shape[2]
    ys = np.zeros(v.shape)
    for b in range(B):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            for t in range(T):
                s[b, h] *= g[b, t, h]
                delta = (v[b, t, h] - s[b, h] @ k[b, t, hk]) * beta[b, t, h]
                s[b, h] += np.outer(delta, k[b, t, hk])
                ys[b, t, h] = s[b, h] @ q[b, t, hk]
    return ys, s


@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:])
def test_reference_matches_numpy(shape):
    inputs = _inputs(*shape, mx.float32)
    y, s = gd.reference(*inputs)
    y_np, s_np = _numpy(*inputs)
    np.testing.assert_allclose(np.array(y), y_np, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(s), s_np, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend (run on the GPU machine)")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_kernel_matches_reference(shape, dtype):
    from dflash_core.kernels.gated_delta_cuda import gated_delta_cuda

    inputs = _inputs(*shape, dtype)
    y, s = gated_delta_cuda(*inputs)
    y_ref, s_ref = gd.reference(*inputs)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(y_ref.astype(mx.float32)), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.array(s), np.array(s_ref), rtol=tol, atol=tol)
    # A prefix of the steps gives the state the engine's rollback needs.
    n = max(1, shape[1] // 2)
    _, s_prefix = gated_delta_cuda(*(x[:, :n] for x in inputs[:5]), inputs[5])
    _, s_prefix_ref = gd.reference(*(x[:, :n] for x in inputs[:5]), inputs[5])
    np.testing.assert_allclose(np.array(s_prefix), np.array(s_prefix_ref), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]])
def test_step_states_are_the_states_of_shorter_runs(shape):
    inputs = _inputs(*shape, mx.float32)
    y, final, states = gd.gated_delta_step_states(*inputs)
    y_ref, final_ref = gd.gated_delta(*inputs)
    T = shape[1]
    assert states.shape == (shape[0], T) + inputs[5].shape[1:]
    np.testing.assert_allclose(np.array(y), np.array(y_ref), rtol=1e-5, atol=1e-5)
    for t in sorted({0, 1, T // 2, T - 1}):
        _, after_t = gd.gated_delta(*(x[:, : t + 1] for x in inputs[:5]), inputs[5])
        assert mx.array_equal(states[:, t], after_t).item(), t
    assert mx.array_equal(states[:, -1], final).item()


@pytest.mark.parametrize("shape", [SHAPES[1], (3, 16, 2, 4, 64, 32)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_replayed_deltas_are_the_states_of_shorter_runs(shape, dtype):
    """A verify that records each step's delta (`gated_delta_deltas`) lets `replay` rebuild each
    row's state after its first `keep` steps bit for bit as running only those steps gives it (on
    CUDA the kernels; elsewhere the uncompiled steps, `reference_steps`), rows keeping different
    numbers of steps in one replay; and the steps' outputs are the recurrence's."""
    inputs = _inputs(*shape, dtype)
    y, final, deltas = gd.gated_delta_deltas(*inputs)
    B, T = shape[:2]
    assert deltas.shape == (B, T, shape[3], shape[5]) and deltas.dtype == mx.float32
    plain = gd.gated_delta if backend() == "cuda" else gd.reference_steps
    y_plain, final_plain = plain(*inputs)
    assert mx.array_equal(y, y_plain).item() and mx.array_equal(final, final_plain).item()
    y_mlx_lm, final_mlx_lm = gd.reference(*inputs)
    np.testing.assert_allclose(np.array(final.astype(mx.float32)), np.array(final_mlx_lm), rtol=1e-4, atol=1e-4)
    q, k, v, g, beta, state = inputs
    for keeps in ([T] * B, [1 + (5 * b + 3) % (T - 1) for b in range(B)], [1] * B):
        replayed = gd.replay(k, g, deltas, state, keeps)
        for b, keep in enumerate(keeps):
            _, alone = plain(*(x[b : b + 1, :keep] for x in inputs[:5]), state[b : b + 1])
            assert mx.array_equal(replayed[b : b + 1], alone).item(), (keeps, b)


@pytest.mark.skipif(backend() != "metal", reason="needs Metal")
@pytest.mark.parametrize("shape", SHAPES)
def test_metal_kernel_matches_reference(shape):
    inputs = _inputs(*shape, mx.float32)
    y, s = gd.gated_delta(*inputs)
    y_ref, s_ref = gd.reference(*inputs)
    np.testing.assert_allclose(np.array(y), np.array(y_ref), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(s), np.array(s_ref), rtol=1e-4, atol=1e-4)


def test_gate_picks_a_path_for_this_backend():
    q, k, v, g, beta, state = _inputs(*SHAPES[1], mx.float32)
    expected = {"cpu": "reference", "cuda": "cuda", "metal": "metal"}[backend()]
    assert gd.path_for(q, v, g) == expected
    # Shapes a kernel does not handle fall back to the reference everywhere.
    q_odd = mx.zeros((1, 2, 2, 24))
    assert gd.path_for(q_odd, v, g) == "reference"


# ----- attention of a verify or draft block (dflash_core/kernels/attention.py)

from dflash_core.kernels import attention as block_attention  # noqa: E402


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (4, 4, 64), (16, 4, 128), (8, 1, 512)])
@pytest.mark.parametrize("queries", [2, 7, 16])
def test_stacked_attention_matches_fused(heads, kv_heads, dim, queries):
    """Stacked query heads, key segments, and both mask shapes give MLX's fused attention."""
    mx.random.seed(1)
    B, T1, T2 = 2, 300, queries
    q = mx.random.normal((B, heads, queries, dim))
    k1, v1 = mx.random.normal((B, kv_heads, T1, dim)), mx.random.normal((B, kv_heads, T1, dim))
    k2, v2 = mx.random.normal((B, kv_heads, T2, dim)), mx.random.normal((B, kv_heads, T2, dim))
    keys, values = mx.concatenate([k1, k2], axis=2), mx.concatenate([v1, v2], axis=2)
    start = 250  # the first buffer's tail (250..299) is unused, as in the engine's bucketed caches
    key_pos = mx.concatenate([mx.where(mx.arange(T1) < start, mx.arange(T1), 1 << 30), start + mx.arange(T2)])
    mask = key_pos[None] <= (start + mx.arange(queries))[:, None]  # [L, T]
    scale = dim**-0.5
    cases = [
        (mask, [k1, k2], [v1, v2]),
        (mask, [keys], [values]),
        (mx.broadcast_to(mask, (B, 1) + mask.shape), [k1, k2], [v1, v2]),  # training's [B, 1, L, T]
        (mx.broadcast_to(mask, (B, heads) + mask.shape), [keys], [values]),
        (mx.broadcast_to(mask, (1, heads) + mask.shape), [k1, k2], [v1, v2]),  # one mask for the batch
    ]
    for m, ks, vs in cases:
        expected = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=m)
        got = block_attention.stacked(q, ks, vs, scale, m)
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-5)


def test_attention_gate(monkeypatch):
    q16 = mx.zeros((1, 8, 16, 128))
    mask = mx.ones((16, 64), mx.bool_)
    from dflash_core.kernels.cpu_extension import extension

    on_cpu = "cpu" if extension() is not None else "fused"  # our softmax where the extension builds
    assert block_attention.path_for(q16, mask) == {"cuda": "stacked", "cpu": on_cpu}.get(backend(), "fused")
    monkeypatch.setattr(block_attention, "backend", lambda: "cuda")
    assert block_attention.path_for(q16, mask) == "stacked"
    assert block_attention.path_for(q16[:, :, :1], mask[:1]) == "fused"  # decode: MLX's vector kernel
    assert block_attention.path_for(q16, None) == "fused"
    assert block_attention.path_for(q16, "causal") == "fused"
    assert block_attention.path_for(mx.zeros((1, 8, 16, 512)), mask) == "stacked"  # Gemma 4 global
    assert block_attention.path_for(mx.zeros((1, 8, 16, 576)), mask) == "fused"
    additive = mx.where(mask, 0.0, -mx.inf)  # an additive mask would be misread as a boolean one
    assert block_attention.path_for(q16, additive) == "fused"
    assert block_attention.path_for(q16, mask, KernelOptions(block_attention=False)) == "fused"  # a benchmark's arm


# ----- 4-bit weight products of decode and verify (dflash_core/kernels/matmul.py)

import mlx.nn as nn  # noqa: E402

from dflash_core.kernels import matmul as small_m  # noqa: E402

cuda_only = pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend (run on the GPU machine)")


def _quantized_linear(n, k, group_size=64, bits=4, bias=False, dtype=mx.bfloat16, seed=0):
    mx.random.seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    layer.weight = mx.random.normal((n, k)) * k**-0.5
    if bias:
        layer.bias = mx.random.normal((n,))
    layer.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(layer, group_size=group_size, bits=bits)


def test_small_m_gate(monkeypatch):
    """Which products the CUDA kernel takes: 4-bit affine weights, bf16, 1..16 rows, K % 128 == 0,
    an Ampere or newer GPU."""
    from dflash_core.kernels import quantized_matmul_cuda

    layer = _quantized_linear(64, 256)
    x = mx.zeros((1, 16, 256), mx.bfloat16)
    assert small_m.path_for(layer, x) == ("cuda" if backend() == "cuda" else "mlx")
    monkeypatch.setattr(small_m, "backend", lambda: "cuda")
    assert small_m.path_for(layer, x) == "cuda"
    assert small_m.path_for(layer, x[:, :1]) == "cuda"  # decode
    assert small_m.path_for(layer, mx.zeros((1, 17, 256), mx.bfloat16)) == "mlx"  # prefill
    assert small_m.path_for(layer, x.astype(mx.float32)) == "mlx"
    assert small_m.path_for(_quantized_linear(64, 256, bits=8), x) == "mlx"
    assert small_m.path_for(_quantized_linear(64, 192), mx.zeros((1, 4, 192), mx.bfloat16)) == "mlx"  # K % 128
    assert small_m.path_for(_quantized_linear(40, 256), x) == "mlx"  # N % 16
    plain = nn.Linear(256, 64)
    plain.set_dtype(mx.bfloat16)
    assert small_m.path_for(plain, x, KernelOptions(bf16_stream=False)) == "mlx"  # bf16: MLX's GEMM when asked
    half_scales = _quantized_linear(64, 256)
    half_scales.scales = half_scales.scales.astype(mx.float16)
    assert small_m.path_for(half_scales, x) == "mlx"
    assert small_m.path_for(layer, x, KernelOptions(cuda_matmul=False)) == "mlx"
    monkeypatch.setattr(quantized_matmul_cuda, "has_bf16_mma", lambda: False)  # e.g. a Turing card
    assert small_m.path_for(layer, x) == "mlx"


def _quantized_mlp(dim, hidden):
    from mlx_lm.models.qwen3 import MLP

    mx.random.seed(3)
    mlp = MLP(dim, hidden)
    mlp.set_dtype(mx.bfloat16)
    nn.quantize(mlp, group_size=64, bits=4)
    return mlp


def test_mlx_path_is_mlx_lm_own_call(monkeypatch):
    """Off the kernel, `gated_mlp` composes mlx-lm's MLPs exactly (activation, gate and up in place)."""
    from mlx_lm.models.activations import swiglu
    from mlx_lm.models.gemma4_text import MLP as GemmaMLP
    from mlx_lm.models.gemma4_text import ModelArgs as GemmaArgs
    from mlx_lm.models.gemma4_text import geglu

    mlx_only = KernelOptions(cuda_matmul=False)  # the MLX path on every backend
    mlp = _quantized_mlp(128, 256)
    x = mx.random.normal((1, 5, 128)).astype(mx.bfloat16)
    assert mx.array_equal(small_m.gated_mlp(mlp, x, swiglu, mlx_only), mlp(x))
    assert not mx.array_equal(small_m.gated_mlp(mlp, x, geglu, mlx_only), mlp(x))  # the check can fail
    gemma = GemmaMLP(GemmaArgs.from_dict({"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
                                          "num_kv_shared_layers": 0}))
    gemma.set_dtype(mx.bfloat16)
    assert mx.array_equal(small_m.gated_mlp(gemma, x, geglu, mlx_only), gemma(x))


def test_kernel_path_has_a_gradient(monkeypatch):
    """`dflash train` can send a drafter block (<= 16 rows) through a 4-bit LM head: the kernel's
    product must pass x's gradient on, summed over the weights of one launch. Here a
    non-differentiable stand-in plays the kernel."""
    from dflash_core.kernels import quantized_matmul_cuda

    def stand_in(x, weights, group_size):
        return [mx.stop_gradient(mx.quantized_matmul(x, *weight, transpose=True, group_size=group_size, bits=4))
                for weight in weights]

    monkeypatch.setattr(small_m, "backend", lambda: "cuda")
    monkeypatch.setattr(quantized_matmul_cuda, "quantized_matmuls_cuda", stand_in)
    layer, other = _quantized_linear(64, 128), _quantized_linear(32, 128)
    x = mx.random.normal((1, 15, 128)).astype(mx.bfloat16)
    assert small_m.path_for(layer, x) == "cuda"
    for through_kernel, own in [
        (lambda x: small_m.linear(layer, x).astype(mx.float32).sum(), lambda x: layer(x).astype(mx.float32).sum()),
        (lambda x: sum((y.astype(mx.float32) ** 2).sum() for y in small_m.linears([layer, other], x)),
         lambda x: (layer(x).astype(mx.float32) ** 2).sum() + (other(x).astype(mx.float32) ** 2).sum()),
    ]:
        grad, expected = mx.grad(through_kernel)(x), mx.grad(own)(x)
        assert grad.shape == x.shape and mx.abs(grad).max().item() > 0
        np.testing.assert_allclose(np.array(grad.astype(mx.float32)), np.array(expected.astype(mx.float32)),
                                   rtol=0.02, atol=0.02)


def test_projections_sharing_an_input_share_a_launch(monkeypatch):
    """`linears` sends the layers the kernel takes in one launch per group size and the others
    through mlx-lm's own calls, each layer's bias added to its own output."""
    from dflash_core.kernels import quantized_matmul_cuda

    launches = []

    def stand_in(x, weights, group_size):
        launches.append(len(weights))
        return [mx.quantized_matmul(x, *weight, transpose=True, group_size=group_size, bits=4) for weight in weights]

    monkeypatch.setattr(small_m, "backend", lambda: "cuda")
    monkeypatch.setattr(quantized_matmul_cuda, "quantized_matmuls_cuda", stand_in)
    q, k, v = _quantized_linear(128, 256, bias=True), _quantized_linear(64, 256), _quantized_linear(32, 256)
    x = mx.random.normal((1, 3, 256)).astype(mx.bfloat16)
    for got, layer in zip(small_m.linears([q, k, v], x), [q, k, v]):
        assert mx.array_equal(got, layer(x))
    assert launches == [3]
    # An 8-bit layer keeps mlx-lm's call; another group size gets its own launch.
    for odd_one, expected_launches in ((_quantized_linear(64, 256, bits=8), [2]),
                                       (_quantized_linear(64, 256, group_size=32), [2, 1])):
        launches.clear()
        for got, layer in zip(small_m.linears([q, odd_one, k], x), [q, odd_one, k]):
            assert mx.array_equal(got, layer(x))
        assert launches == expected_launches
    launches.clear()
    small_m.linears([q, k, v], x, KernelOptions(one_launch_per_input=False))
    assert launches == [1, 1, 1]


def test_stacked_projections_keep_memory_and_outputs(monkeypatch):
    """bf16 projections sharing an input become views of one matrix (no memory added; the same
    weights) and `linears` hands each layer its own columns from one GEMM."""
    import gc

    SharedInput = small_m.SharedInput
    monkeypatch.setattr(small_m, "backend", lambda: "cuda")
    mx.random.seed(11)
    layers = [nn.Linear(256, n, bias=False) for n in (128, 64, 32)]
    for layer in layers:
        layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 5, 256)).astype(mx.bfloat16)
    expected = [layer(x) for layer in layers]
    weights = [layer.weight for layer in layers]
    mx.eval(expected, weights)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    shared = SharedInput(layers)
    assert shared.stacked
    weights = None
    gc.collect()
    mx.clear_cache()
    assert mx.get_active_memory() <= before
    assert small_m._stacked_products(shared, x) is not None  # the one-GEMM path is taken
    assert small_m._stacked_products(layers, x) is None  # a plain list is not a stack
    gemm = KernelOptions(bf16_stream=False)  # MLX's GEMM on the stack (the stream kernel needs a GPU)
    for got, want, layer in zip(small_m.linears(shared, x, gemm), expected, layers):
        assert got.shape == want.shape
        assert mx.array_equal(got, want)  # exact on this CPU: a column's dot products are the same
        assert mx.array_equal(layer(x), want)  # mlx-lm's own call reads the same weights
    # The kernel options a benchmark turns off: the layers one by one, as mlx-lm calls them.
    for kernels in (KernelOptions(one_launch_per_input=False, bf16_stream=False), KernelOptions(cuda_matmul=False)):
        assert all(mx.array_equal(got, want) for got, want in zip(small_m.linears(shared, x, kernels), expected))
    # Stacking the same layers again (its first stack let go) adds nothing either.
    shared = None
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    shared = SharedInput(layers)
    assert shared.stacked
    gc.collect()
    mx.clear_cache()
    assert mx.get_active_memory() <= before
    assert all(mx.array_equal(got, want) for got, want in zip(small_m.linears(shared, x, gemm), expected))
    layers[1].weight = layers[1].weight + 0  # a weight replaced after stacking: no longer stacked
    assert small_m._stacked_products(shared, x) is None
    assert not shared.stacked  # the old matrix is let go
    for got, layer in zip(small_m.linears(shared, x, gemm), layers):
        assert mx.array_equal(got, layer(x))
    # Not stacked: quantized layers (the kernel's), a bias (added inside nn.Linear's GEMM), inputs
    # of different widths or dtypes, a single layer, the kernel options off, other backends.
    assert not SharedInput([_quantized_linear(64, 256), _quantized_linear(64, 256)]).stacked
    assert not SharedInput([nn.Linear(256, 64), nn.Linear(256, 64, bias=True)]).stacked
    assert not SharedInput([nn.Linear(256, 64), nn.Linear(128, 64)]).stacked
    half = nn.Linear(256, 64)
    half.set_dtype(mx.float16)
    assert not SharedInput([nn.Linear(256, 64), half]).stacked
    assert not SharedInput([nn.Linear(256, 64)]).stacked
    assert not SharedInput([nn.Linear(256, 64), nn.Linear(256, 64)], KernelOptions(cuda_matmul=False)).stacked
    monkeypatch.setattr(small_m, "backend", lambda: "cpu")
    assert not SharedInput([nn.Linear(256, 64), nn.Linear(256, 64)]).stacked


def _dequantized_product(x, layer):
    w = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=4)
    return x.astype(mx.float32) @ w.astype(mx.float32).T


@cuda_only
@pytest.mark.parametrize("n,k,group_size", [(256, 256, 64), (1024, 4096, 64), (4096, 1024, 64), (32, 4096, 64),
                                            (48, 384, 64), (1024, 4096, 32), (1024, 4096, 128)])
def test_quantized_kernel_matches_reference(n, k, group_size):
    """Within bf16 rounding of MLX's own quantized matmul, for every token count 1..16."""
    from dflash_core.kernels.quantized_matmul_cuda import quantized_matmul_cuda

    layer = _quantized_linear(n, k, group_size=group_size)
    mx.random.seed(7)
    x = mx.random.normal((16, k)).astype(mx.bfloat16)
    for m in (1, 7, 9, 16):
        expected = _dequantized_product(x[:m], layer)
        got = quantized_matmul_cuda(x[:m], layer.weight, layer.scales, layer.biases, group_size).astype(mx.float32)
        mlx_own = layer(x[:m]).astype(mx.float32)
        scale = mx.sqrt(mx.mean(expected * expected)).item()
        ours_err = mx.max(mx.abs(got - expected)).item()
        mlx_err = mx.max(mx.abs(mlx_own - expected)).item()
        assert ours_err <= max(2 * mlx_err, 0.01 * scale), (m, ours_err, mlx_err, scale)


@cuda_only
@pytest.mark.parametrize("n,k", [(2048, 4096), (12288, 4096), (48, 384), (32768, 512)])
def test_quantized_kernel_is_row_invariant(n, k):
    """A token's output is bit-identical alone (decode) and in any block of up to 16 (verify).
    The shapes cover 4 warps splitting K evenly, 3 unevenly (12288 x 4096, the MLP's), one row
    tile per warp (48 rows) and one warp per block (an LM head's many rows)."""
    from dflash_core.kernels.quantized_matmul_cuda import quantized_matmul_cuda

    layer = _quantized_linear(n, k)
    mx.random.seed(8)
    x = mx.random.normal((16, k)).astype(mx.bfloat16)
    other = mx.random.normal((16, k)).astype(mx.bfloat16)
    args = (layer.weight, layer.scales, layer.biases, 64)
    block = quantized_matmul_cuda(x, *args)
    for i in range(16):
        assert mx.array_equal(quantized_matmul_cuda(x[i : i + 1], *args)[0], block[i])
    mixed = quantized_matmul_cuda(mx.concatenate([x[:3], other[3:]]), *args)
    assert mx.array_equal(mixed[:3], block[:3])


@cuda_only
@pytest.mark.parametrize("ns,k", [((2048, 512, 512), 1024), ((4096, 2048, 32, 32), 512), ((48, 256), 384)])
def test_one_launch_for_several_weights(ns, k):
    """Weights sharing x in one launch (q, k, v; Qwen3.5's qkv, z, b, a; one with 48 rows, so
    one row tile for all): each product within bf16 rounding, and row-invariant as one weight is."""
    from dflash_core.kernels.quantized_matmul_cuda import quantized_matmuls_cuda

    layers = [_quantized_linear(n, k) for n in ns]
    weights = [(layer.weight, layer.scales, layer.biases) for layer in layers]
    mx.random.seed(10)
    x = mx.random.normal((16, k)).astype(mx.bfloat16)
    block = quantized_matmuls_cuda(x, weights, 64)
    for got, layer in zip(block, layers):
        expected = _dequantized_product(x, layer)
        mlx_err = mx.max(mx.abs(layer(x).astype(mx.float32) - expected)).item()
        scale = mx.sqrt(mx.mean(expected * expected)).item()
        assert mx.max(mx.abs(got.astype(mx.float32) - expected)).item() <= max(2 * mlx_err, 0.01 * scale)
    for i in (0, 5, 15):
        for alone, together in zip(quantized_matmuls_cuda(x[i : i + 1], weights, 64), block):
            assert mx.array_equal(alone[0], together[i])


@cuda_only
def test_linear_and_tied_head_through_the_kernel():
    mx.random.seed(9)
    layer = _quantized_linear(512, 1024, bias=True)
    x = mx.random.normal((1, 16, 1024)).astype(mx.bfloat16)
    assert small_m.path_for(layer, x) == "cuda"
    got, expected = small_m.linear(layer, x), layer(x)
    assert got.shape == expected.shape == (1, 16, 512)
    _assert_close(got, expected)
    embedding = nn.Embedding(512, 1024)
    embedding.set_dtype(mx.bfloat16)
    embedding = nn.QuantizedEmbedding.from_embedding(embedding, group_size=64, bits=4)
    got, expected = small_m.tied_lm_head(embedding, x), embedding.as_linear(x)
    _assert_close(got, expected)
    from mlx_lm.models.activations import swiglu

    mlp = _quantized_mlp(1024, 2048)
    got, expected = small_m.gated_mlp(mlp, x, swiglu), mlp(x)
    _assert_close(got, expected)
    other = _quantized_linear(256, 1024)
    for got, layer in zip(small_m.linears([layer, other], x), [layer, other]):
        _assert_close(got, layer(x))


def _assert_close(got, expected):
    """Within 3% of the output's largest magnitude: bf16 rounding, not a wrong layout or scale."""
    got, expected = got.astype(mx.float32), expected.astype(mx.float32)
    assert mx.abs(got - expected).max().item() <= 0.03 * mx.abs(expected).max().item()


def test_bf16_stream_gate(monkeypatch):
    """The bf16 stream kernel takes bf16 plain linears and embeddings of <= 32 rows on CUDA (unless
    `bf16_stream` is off); never quantized, float32 or wider products."""
    stream = KernelOptions(bf16_stream=True)
    plain = nn.Linear(256, 64, bias=False)
    plain.set_dtype(mx.bfloat16)
    x = mx.zeros((1, 16, 256), mx.bfloat16)
    assert small_m.path_for(plain, x, stream) == ("stream" if backend() == "cuda" else "mlx")
    monkeypatch.setattr(small_m, "backend", lambda: "cuda")
    assert small_m.path_for(plain, x) == "stream"  # on by default
    assert small_m.path_for(plain, x[:, :1]) == "stream"  # decode
    assert small_m.path_for(plain, x, KernelOptions(bf16_stream=False)) == "mlx"
    assert small_m.path_for(plain, mx.zeros((1, 33, 256), mx.bfloat16), stream) == "mlx"  # prefill
    assert small_m.path_for(plain, x.astype(mx.float32), stream) == "mlx"
    assert small_m.path_for(_quantized_linear(64, 256), x, stream) == "cuda"  # 4-bit keeps its kernel
    assert small_m.path_for(plain, x, KernelOptions(bf16_stream=True, cuda_matmul=False)) == "mlx"
    odd = nn.Linear(256, 40, bias=False)  # N % 16
    odd.set_dtype(mx.bfloat16)
    assert small_m.path_for(odd, x, stream) == "mlx"


class _Calls(list):
    """Row counts of the stream path's calls, and in `parts` the output count of each split call."""

    def __init__(self):
        super().__init__()
        self.parts = []


@pytest.fixture
def stream_on_cpu(monkeypatch):
    """The stream path's wiring on this CPU: the gate as on CUDA, float32 accepted, and the kernel
    replaced by a product that is row-invariant here (what the real kernel guarantees, and what
    the CUDA tests below check on the GPU). Returns the calls' row counts."""
    from dflash_core.kernels import bf16_matmul_cuda

    calls = _Calls()
    real_supported = bf16_matmul_cuda.supported
    monkeypatch.setattr(small_m, "backend", lambda: "cuda")
    monkeypatch.setattr(bf16_matmul_cuda, "supported", lambda rows, x, w: real_supported(
        rows, x.astype(mx.bfloat16), w.astype(mx.bfloat16)))
    monkeypatch.setattr(bf16_matmul_cuda, "matmul_stream", lambda x, w: calls.append(x.shape[0]) or (
        (x[:, None, :] * w[None]).sum(-1)))

    def parts(x, w, splits):
        calls.append(x.shape[0])
        calls.parts.append(len(splits) + 1)
        return mx.split((x[:, None, :] * w[None]).sum(-1), list(splits), axis=-1)

    monkeypatch.setattr(bf16_matmul_cuda, "matmul_stream_parts", parts)
    small_m._stream_product.cache_clear()
    small_m._stream_parts.cache_clear()
    yield calls
    small_m._stream_product.cache_clear()
    small_m._stream_parts.cache_clear()


def test_stream_path_has_the_gradient_of_the_product(stream_on_cpu):
    """`dflash train` trains drafter projections that go through the stream kernel on CUDA: the
    kernel's product has the gradient of `x @ W.T` in x and in W."""
    mx.random.seed(13)
    layer = nn.Linear(64, 32, bias=False)
    x = mx.random.normal((1, 16, 64))

    def loss(weight, x, through_kernel):
        layer.weight = weight
        y = small_m.linear(layer, x) if through_kernel else layer(x)
        return (y * mx.arange(32)).sum()

    got = mx.grad(loss, argnums=(0, 1))(layer.weight, x, True)
    assert stream_on_cpu == [16]  # it went through the kernel's path
    expected = mx.grad(loss, argnums=(0, 1))(layer.weight, x, False)
    for g, e in zip(got, expected):
        assert mx.allclose(g, e, atol=1e-4)


def test_stacked_parts_have_the_gradient_of_the_products(stream_on_cpu):
    """Projections stacked at load (a `SharedInput`) come out of the stream path as arrays of their
    own; through them `dflash train` gets the gradient of each `x @ W_i.T`."""
    mx.random.seed(14)
    gate, up = nn.Linear(64, 32, bias=False), nn.Linear(64, 48, bias=False)
    x = mx.random.normal((1, 16, 64))
    shared = small_m.SharedInput([gate, up])
    assert shared.stacked

    def loss(weight, x, through_kernel):
        shared.weight = weight
        shared.views = (gate.weight, up.weight) = (weight[:32], weight[32:])
        g, u = small_m.linears(shared, x, KernelOptions(stream_parts=True)) if through_kernel else (gate(x), up(x))
        assert g.shape == (1, 16, 32) and u.shape == (1, 16, 48)
        return (g * mx.arange(32)).sum() + (u * u).sum()

    weight = shared.weight
    got = mx.grad(loss, argnums=(0, 1))(weight, x, True)
    assert stream_on_cpu == [16]  # one product for both
    expected = mx.grad(loss, argnums=(0, 1))(weight, x, False)
    for g, e in zip(got, expected):
        assert mx.allclose(g, e, atol=1e-4)


@pytest.mark.parametrize("stream_parts", [False, True], ids=["column-copies", "split-outputs"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma3_text"])
def test_stream_path_is_lossless(request, family, stream_parts, stream_on_cpu):
    """Decode, verify and draft products through the stream path (as on CUDA, with a row-invariant
    product standing in for the kernel), stacked projections' outputs as columns of one product or
    as arrays of their own: speculative output equals target-alone output at every acceptance length."""
    from dataclasses import replace

    from test_lossless import N_TOKENS, _check_every_acceptance_length, _prompt, _run

    from dflash_core.engine import Engine
    from dflash_core.loading import load_engine

    target, drafter = request.getfixturevalue(f"{family}_pair")
    loaded = load_engine(str(target), str(drafter), prefill_chunk=16)
    kernels = replace(loaded.target.kernels, stream_parts=stream_parts)
    engine = Engine(loaded.target.with_kernels(kernels), loaded.tokenizer, loaded.drafter.with_kernels(kernels),
                    prefill_chunk=16)
    prompt = _prompt(engine)
    reference, _ = _run(engine, prompt, max_tokens=N_TOKENS + 16, speculative=False)
    assert 1 in stream_on_cpu  # decode steps took it
    tokens, _ = _run(engine, prompt)
    assert 16 in stream_on_cpu  # verifies and drafts took it
    assert bool(stream_on_cpu.parts) == stream_parts  # stacked projections came out as arrays of their own
    assert tokens == reference[:N_TOKENS]
    _check_every_acceptance_length({family: engine}, {family: (prompt, reference)}, family)


@cuda_only
@pytest.mark.parametrize("n,k", [(4096, 4096), (12288, 4096), (4096, 12288), (48, 384), (32768, 512)])
def test_bf16_stream_kernel_is_close_and_row_invariant(n, k):
    """Within bf16 rounding of MLX's matmul for 1..32 rows, and a token's output bit-identical
    alone (decode) and in any block (verify), as the lossless loop needs."""
    from dflash_core.kernels.bf16_matmul_cuda import matmul_stream

    mx.random.seed(11)
    w = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
    x = mx.random.normal((32, k)).astype(mx.bfloat16)
    for m in (1, 7, 16, 32):
        _assert_close(matmul_stream(x[:m], w), x[:m] @ w.T)
    block = matmul_stream(x[:16], w)
    for i in range(16):
        assert mx.array_equal(matmul_stream(x[i : i + 1], w)[0], block[i])
    assert mx.array_equal(matmul_stream(x, w)[:16], block)


@cuda_only
@pytest.mark.parametrize("splits", [(4096,), (2048, 3072), (256, 512, 3584)])
def test_bf16_stream_parts_are_the_products_columns(splits):
    """A stacked weight's parts as outputs of their own: each the same bits as its columns of the
    one product, contiguous, for a decode's row and a verify's block."""
    from dflash_core.kernels.bf16_matmul_cuda import matmul_stream, matmul_stream_parts

    mx.random.seed(15)
    w = (mx.random.normal((4096 + 1024, 1024)) * 1024**-0.5).astype(mx.bfloat16)
    x = mx.random.normal((32, 1024)).astype(mx.bfloat16)
    for m in (1, 16, 32):
        whole = matmul_stream(x[:m], w)
        parts = matmul_stream_parts(x[:m], w, splits)
        for part, columns in zip(parts, mx.split(whole, list(splits), axis=-1)):
            assert part.shape == columns.shape
            assert mx.array_equal(part, columns)


@cuda_only
def test_linears_and_tied_head_through_the_stream_kernel():
    """With `bf16_stream`, stacked projections, a plain linear with a bias and a tied head give
    MLX's products within bf16 rounding."""
    from mlx_lm.models.activations import swiglu
    from mlx_lm.models.qwen3 import MLP

    stream = KernelOptions(bf16_stream=True)
    mx.random.seed(12)
    x = mx.random.normal((1, 16, 1024)).astype(mx.bfloat16)
    mlp = MLP(1024, 2048)
    mlp.set_dtype(mx.bfloat16)
    expected = mlp(x)
    gate_up = small_m.SharedInput([mlp.gate_proj, mlp.up_proj], stream)
    assert gate_up.stacked
    _assert_close(small_m.gated_mlp(mlp, x, swiglu, stream, gate_up), expected)
    layer = nn.Linear(1024, 512, bias=True)
    layer.set_dtype(mx.bfloat16)
    assert small_m.path_for(layer, x, stream) == "stream"
    _assert_close(small_m.linear(layer, x, stream), layer(x))
    embedding = nn.Embedding(512, 1024)
    embedding.set_dtype(mx.bfloat16)
    _assert_close(small_m.tied_lm_head(embedding, x, stream), embedding.as_linear(x))

    def loss(weight, x, through_kernel):  # the gradient `dflash train` takes through a drafter's linear
        layer.weight = weight
        return (small_m.linear(layer, x, stream) if through_kernel else layer(x)).astype(mx.float32).sum()

    for got, expected in zip(mx.grad(loss, argnums=(0, 1))(layer.weight, x, True),
                             mx.grad(loss, argnums=(0, 1))(layer.weight, x, False)):
        _assert_close(got, expected)


def test_q4_launch_shape_splits_k_by_the_weights_alone():
    """The warps splitting K fix the order of the sum: they may depend on the weights' shapes only,
    never on the rows multiplied (a token's logits must not change between decode and verify), and
    stay within what a block of 16 rows can hold (8 warps)."""
    from dflash_core.kernels.quantized_matmul_cuda import MAX_ROWS, launch_shape

    for ns, k in [((12352,), 4096), ((24576,), 4096), ((4096,), 12288), ((4096,), 4096), ((248320,), 4096),
                  ((4096, 1024, 1024), 4096), ((48,), 256)]:
        shapes = [launch_shape(ns, k, m) for m in range(1, MAX_ROWS + 1)]
        assert len({(nw, mt) for nw, mt, _ in shapes}) == 1, (ns, k, shapes)
        assert 1 <= shapes[0][0] <= min(8, k // 128)
    assert launch_shape((4096,), 12288, 16)[0] == 8  # small weights get the warps the sweep found faster


@cuda_only
def test_a_drafters_context_is_the_same_however_its_taps_arrive():
    """A cycle's taps go through the drafter's `fc` in the stream kernel, which rounds a row alike
    whatever rows share the call: the context of 16 taps added at once (a verify's) is the bits of
    one at a time (plain steps'). Through MLX's GEMM it was not (0.0156 apart on an H200, bf16, the
    Gemma 3 270M drafter's shape, 2026-12-07; docs/performance.md, "The drafter's fc")."""
    from forced import context_difference

    from dflash_core.random_models import parse_shape, random_drafter, random_target

    name, tiny = parse_shape("gemma-3-270m")
    drafter = random_drafter(name, random_target(name, "bf16", tiny=tiny), tiny)
    assert context_difference(drafter, mx.bfloat16) == 0.0
