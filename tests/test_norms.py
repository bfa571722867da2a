"""Residual adds and the RMS norms beside them (dflash_core/kernels/norms.py): by default MLX's own ops
in mlx-lm's order; with `fused_norms` on CUDA one launch of our kernel (residual_norm_cuda.py) whose
sums are MLX's bits, whose norms are MLX's to a rounding, and whose rows do not depend on the rows
beside them (the CUDA tests run on the GPU machine)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_core.kernels import KernelOptions, backend, norms, residual_norm_cuda

cuda_only = pytest.mark.skipif(backend() != "cuda", reason="needs MLX's CUDA backend (run on the GPU machine)")
OFF = KernelOptions()
ON = KernelOptions(fused_norms=True)


def _arrays(rows, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    h, r = (mx.array(rng.normal(size=(1, rows, D)) * 4, dtype=dtype) for _ in range(2))
    w, w2 = (mx.array(rng.normal(size=(D,)), dtype=dtype) for _ in range(2))
    return h, r, w, w2


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_mlx_path_is_mlx_lm_order(dtype):
    h, r, w, w2 = _arrays(5, 64, dtype)
    s, n = norms.add_norm(h, r, w, 1e-6, OFF)
    assert mx.array_equal(s, h + r) and mx.array_equal(n, mx.fast.rms_norm(h + r, w, 1e-6))
    s, n = norms.add_norm(h, r, w, 1e-6, OFF, branch=(w2, 1e-5))
    want = h + mx.fast.rms_norm(r, w2, 1e-5)
    assert mx.array_equal(s, want) and mx.array_equal(n, mx.fast.rms_norm(want, w, 1e-6))
    assert mx.array_equal(norms.add_normed(h, r, w2, 1e-5, OFF), want)
    if backend() != "cuda":  # the kernel's options take the same path here
        assert mx.array_equal(norms.add_norm(h, r, w, 1e-6, ON)[1], mx.fast.rms_norm(h + r, w, 1e-6))


def test_what_the_kernel_takes():
    h, r, w, _ = _arrays(3, 640, mx.bfloat16)
    assert residual_norm_cuda.supported(h, r, w, None)
    assert not residual_norm_cuda.supported(h.astype(mx.float16), r.astype(mx.float16), w.astype(mx.float16))
    assert not residual_norm_cuda.supported(h, r, w.astype(mx.float32))  # a weight of another dtype
    assert not residual_norm_cuda.supported(h, r[:, :2], w)
    big = mx.zeros((1, 1, residual_norm_cuda.MAX_DIM + 64), mx.bfloat16)
    assert not residual_norm_cuda.supported(big, big, mx.zeros((big.shape[-1],), mx.bfloat16))
    assert norms._fused(ON, h, r, w) == (backend() == "cuda")
    assert not norms._fused(OFF, h, r, w)


def _ulps(a: mx.array, b: mx.array) -> int:
    """The largest distance between a and b in units of the last place of their dtype."""
    bits = {mx.bfloat16: (np.int16, mx.int16), mx.float32: (np.int32, mx.int32)}[a.dtype]
    ia = np.array(a.view(bits[1])).astype(np.int64)
    ib = np.array(b.view(bits[1])).astype(np.int64)
    return int(np.abs(ia - ib).max())


def _assert_norm_close(ours: mx.array, theirs: mx.array) -> None:
    """A norm equal to MLX's but for the order of its float32 sum of squares: within 2 bf16 ulps
    (the final rounding hides most of it), within 1e-5 relative in float32, where it shows as several
    ulps of a 640-4096-term sum."""
    if ours.dtype == mx.bfloat16:
        assert _ulps(ours, theirs) <= 2
    else:
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-6)


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("D", [640, 4096, 5376])
def test_kernel_against_mlx(dtype, D):
    h, r, w, w2 = _arrays(16, D, dtype, seed=D)
    s, n = norms.add_norm(h, r, w, 1e-6, ON)
    assert mx.array_equal(s, h + r)  # the sum is MLX's, bit for bit
    _assert_norm_close(n, mx.fast.rms_norm(s, w, 1e-6))
    s, n = norms.add_norm(h, r, w, 1e-6, ON, branch=(w2, 1e-6))
    want = h + mx.fast.rms_norm(r, w2, 1e-6)
    np.testing.assert_allclose(np.array(s.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2e-2 if dtype == mx.bfloat16 else 1e-5, atol=1e-2 if dtype == mx.bfloat16 else 1e-5)
    _assert_norm_close(n, mx.fast.rms_norm(s, w, 1e-6))
    assert mx.array_equal(norms.add_normed(h, r, w2, 1e-6, ON), s)  # the same sum by the add-only kernel


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_row_is_the_same_alone_and_among_sixteen(dtype):
    h, r, w, w2 = _arrays(16, 4096, dtype, seed=1)
    block = norms.add_norm(h, r, w, 1e-6, ON, branch=(w2, 1e-6))
    for i in (0, 7, 15):
        alone = norms.add_norm(h[:, i : i + 1], r[:, i : i + 1], w, 1e-6, ON, branch=(w2, 1e-6))
        assert all(mx.array_equal(a, b[:, i : i + 1]) for a, b in zip(alone, block))


@cuda_only
def test_the_kernels_gradient_is_mlx_ops_gradient():
    """`dflash train` sends drafter layers through the kernel: its gradient is that of MLX's ops."""
    h, r, w, w2 = _arrays(16, 640, mx.float32, seed=2)

    def loss(kernels):
        def f(h, r, w, w2):
            s, n = norms.add_norm(h, r, w, 1e-6, kernels, branch=(w2, 1e-6))
            return (s * s).sum() + (n * mx.arange(640)).sum() + norms.add_normed(h, r, w2, 1e-6, kernels).sum()
        return mx.grad(f, argnums=(0, 1, 2, 3))(h, r, w, w2)

    for ours, theirs in zip(loss(ON), loss(OFF)):
        np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-4, atol=1e-4)
