"""Residual adds and the RMS norms next to them in decode, verify and draft forwards, behind the gate.

Adapters call `add_norm(h, r, weight, eps)` where a layer adds a branch to its residual stream and
normalises the sum (`h = h + r; x = norm(h)`), and `add_normed(h, r, weight, eps)` where it adds a
normalised branch (Gemma: `h = h + norm(r)`), with `branch=` for both at once. They are MLX's own
ops in mlx-lm's order, the same bits as mlx-lm's layers. With `KernelOptions.fused_norms` on, on
CUDA, for bf16 and float32 rows, each is one launch of our kernel (residual_norm_cuda.py) instead of
two or three of MLX's. That is off by default: a Gemma 3 270M step launched a third fewer kernels
with it, but on an H100 with CUDA graphs on the forwards and cycles were no faster above the
machine's noise (docs/performance.md, "Fewer launches: Gemma's norm scales, fused residual norms").
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from . import DEFAULT_KERNELS, KernelOptions, backend, residual_norm_cuda

Norm = tuple[mx.array, float]  # an RMS norm's weight (as MLX's rms_norm takes it) and eps


def norm_of(module) -> Norm:
    """An mlx-lm RMSNorm module's (weight, eps), as its call passes them to MLX's rms_norm."""
    return module.weight, module.eps


def _fused(kernels: KernelOptions, h: mx.array, r: mx.array, *weights) -> bool:
    return kernels.fused_norms and backend() == "cuda" and residual_norm_cuda.supported(h, r, *weights)


def add_norm(h: mx.array, r: mx.array, weight: mx.array, eps: float, kernels: KernelOptions = DEFAULT_KERNELS,
             branch: Optional[Norm] = None) -> tuple[mx.array, mx.array]:
    """(s, rms_norm(s, weight, eps)) with s = h + r, or h + rms_norm(r, *branch) with a `branch` norm."""
    if branch is None:
        if _fused(kernels, h, r, weight):
            return tuple(_kernel(eps, None)(h, r, weight))
        return _mlx(eps, None)(h, r, weight)
    if _fused(kernels, h, r, weight, branch[0]):
        return tuple(_kernel(eps, branch[1])(h, r, weight, branch[0]))
    return _mlx(eps, branch[1])(h, r, weight, branch[0])


def residual(h: mx.array, r: mx.array, next_norm, kernels: KernelOptions = DEFAULT_KERNELS):
    """A layer's last residual add: h + r, or (h + r, next_norm(h + r)) where the next layer's input
    norm (an mlx-lm RMSNorm module) is given, in one launch where the kernel runs."""
    return h + r if next_norm is None else add_norm(h, r, *norm_of(next_norm), kernels)


def add_normed(h: mx.array, r: mx.array, weight: mx.array, eps: float,
               kernels: KernelOptions = DEFAULT_KERNELS) -> mx.array:
    """h + rms_norm(r, weight, eps)."""
    if _fused(kernels, h, r, weight):
        return _kernel(None, eps)(h, r, weight)[0]
    return _mlx(None, eps)(h, r, weight)[0]


@functools.cache
def _mlx(eps: Optional[float], branch_eps: Optional[float]):
    """MLX's ops in mlx-lm's order: (h + r or h + rms_norm(r, branch weight), then its norm where
    `eps` is given); the weights follow h and r: the sum's norm's, then the branch's."""

    def ops(h, r, *weights):
        if branch_eps is not None:
            r = mx.fast.rms_norm(r, weights[-1], branch_eps)
        s = h + r
        return (s,) if eps is None else (s, mx.fast.rms_norm(s, weights[0], eps))

    return ops


@functools.cache
def _kernel(eps: Optional[float], branch_eps: Optional[float]):
    """The kernel for `_mlx(eps, branch_eps)`, differentiable through MLX's ops (`dflash train` sends
    drafter layers through it)."""

    @mx.custom_function
    def fused(h, r, *weights):
        weight = weights[0] if eps is not None else None
        branch = (weights[-1], branch_eps) if branch_eps is not None else ()
        return residual_norm_cuda.residual_norm(h, r, weight, eps or 0.0, *branch)

    @fused.vjp
    def fused_vjp(primals, cotangents, outputs):
        return mx.vjp(_mlx(eps, branch_eps), list(primals), list(cotangents))[1]

    return fused


def active_path(kernels: KernelOptions = DEFAULT_KERNELS) -> str:
    """Which implementation the residual adds and their norms use here (for `dflash doctor`)."""
    if kernels.fused_norms and backend() == "cuda":
        return "dflash CUDA kernel (one launch per residual add and its norms; bf16 and float32 rows)"
    return "MLX ops"
