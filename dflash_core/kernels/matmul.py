"""The weight products of decode and verify forwards (`x @ W.T` for a few rows), behind the gate.

Adapters call `linear(layer, x)` where mlx-lm would call `layer(x)`, and `swiglu_mlp(mlp, x)` for
the gated MLPs. On CUDA, bf16 `nn.Linear` weights multiplied by at most 16 rows use our
tensor-core kernel (matmul_cuda.py); everything else, on every backend, is the layer's own call,
which tests compare the kernel against.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import backend
from . import matmul_cuda

# Switched off by benchmarks to measure MLX's own GEMM in the same process.
use_cuda_kernel = True


def path_for(weight: mx.array, x: mx.array) -> str:
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if use_cuda_kernel and backend() == "cuda" and x.shape[-1] == weight.shape[-1] and matmul_cuda.supported(rows, x.dtype, weight):
        return "cuda"
    return "reference"


@mx.custom_function
def _matmul_cuda(x, weight):
    return matmul_cuda.matmul_cuda(x, weight)


@_matmul_cuda.vjp
def _matmul_cuda_vjp(primals, cotangent, output):
    # The kernel has no gradient of its own; `dflash train` may run the drafter on 16 rows.
    x, weight = primals
    return cotangent @ weight, cotangent.T @ x


def matmul_weight_t(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., K] @ weight[N, K].T."""
    if path_for(weight, x) == "cuda":
        rows = x.reshape(-1, x.shape[-1])
        return _matmul_cuda(rows, weight).reshape(*x.shape[:-1], weight.shape[0])
    return x @ weight.T


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """`layer(x)`, through the small-M kernel for a plain (unquantized) nn.Linear where it runs."""
    if type(layer) is nn.Linear and path_for(layer.weight, x) == "cuda":
        y = matmul_weight_t(x, layer.weight)
        return y + layer.bias if "bias" in layer else y
    return layer(x)


def swiglu_mlp(mlp: nn.Module, x: mx.array) -> mx.array:
    """mlx-lm's Qwen MLP `down(silu(gate(x)) * up(x))` with its projections through `linear`;
    any other feed-forward (Qwen's MoE blocks) is the module's own call."""
    if not hasattr(mlp, "gate_proj"):
        return mlp(x)
    return linear(mlp.down_proj, nn.silu(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x))


def active_path() -> str:
    """Which implementation small-M products use here (for `dflash doctor`)."""
    if backend() == "cuda" and use_cuda_kernel:
        return "dflash CUDA tensor-core kernel for bf16 weights and <= 16 rows; MLX otherwise"
    return "MLX matmul"
