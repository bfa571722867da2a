"""A decode step's weight products on the CPU with narrow weights, inside MLX's graph.

On MLX's CPU backend a decode step of a small model reads its float32 weights through the BLAS
(MKL reaches about 16 GB/s on this project's 2 cores), and MLX has no fast path for narrower
weights: its float16 and quantized CPU matmuls are 4-40x slower than float32 (`benchmarks/
cpu_matmul.py`). So on the CPU a target's large float32 projections get a narrow copy at load
(`add_narrow_copies`), which decode and verify forwards multiply in our kernels (`cpu_linear.cpp`:
AVX2, FMA and F16C, threads) as an MLX primitive: it runs inside the compiled blocks like any op,
with no trip to the host between layers. The copy (`narrow_copy`) is int8 blocks of 32 with a
float32 scale each where the float32 weights are exactly that, as a GGUF's Q8_0, Q5_0 and Q4_0
tensors converted to float32 are, or with a float32 offset each too (Q4_K's): the same weights in
about a quarter of the bytes; else float16 (the weights rounded to float16, products and sums in
float32: half the bytes). Prefill keeps the
float32 weights and MLX's product: at hundreds of rows it is compute-bound, where MKL's GEMM is
the faster one (`TargetAdapter.prefill_kernels`).

Each output is one sum in a fixed order whatever the other rows of the call, so a 16-token verify
and a 1-token step give a token the same result to the bit, and speculative output stays exactly
the target-alone output (tests/test_cpu_linear.py). The copies take memory besides the float32
weights (the demo's: 126 MB).

The primitive is part of this project's C++ MLX extension (cpu_extension.py), compiled on first
use. Where it cannot run (not the CPU backend, not x86-64 Linux with AVX2/FMA/F16C, no C++ compiler or CMake,
`KernelOptions.cpu_narrow_linears` off) MLX multiplies the float32 weights.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..blas import rounds_by_rows
from . import backend
from .cpu_extension import extension
from .cpu_head import affine_blocks, cpu_supports, default_threads, int8_blocks

# Below this a projection's bytes are not what a step costs (and the tests' tiny models keep MLX's).
MIN_PARAMETERS = 1 << 16
FLOAT16_MAX = 65504.0


NARROW_WEIGHT = "_cpu_weight"  # a layer's copy; the leading "_" keeps it out of parameters() and saves


def narrow_linear(x: mx.array, weight: tuple) -> mx.array:
    """x [..., K] float32 @ W.T in the primitive, W a copy made by `narrow_copy`: (float16 [N, K],),
    (int8 [N, K], float32 scales [N, K / 32]) or (int8, scales, float32 biases [N, K / 32]); or the
    float32 weight itself (`fixed_order_weight`)."""
    module = extension()
    if len(weight) == 1:
        linear = module.float_linear if weight[0].dtype == mx.float32 else module.half_linear
        return linear(x, weight[0], default_threads())
    if len(weight) == 2:
        return module.int8_linear(x, *weight, default_threads())
    return module.affine_linear(x, *weight, default_threads())


def narrow_copy(weight: mx.array) -> Optional[tuple]:
    """The copy of a float32 weight [N, K] the primitive multiplies: its int8 blocks where the
    weights are exactly that (a GGUF's Q8_0, Q5_0 or Q4_0 converted to float32: the same weights in a
    quarter of the bytes), or int8 blocks with a bias each (Q4_K's), else float16 (the weights
    rounded: half the bytes); None for a weight beyond float16's range."""
    blocks = int8_blocks(weight)
    if blocks is None:
        blocks = affine_blocks(weight)
    if blocks is not None:
        return tuple(mx.array(a) for a in blocks)
    if mx.abs(weight).max().item() >= FLOAT16_MAX:
        return None
    return (weight.astype(mx.float16),)


def fixed_order_weight(weight: Optional[mx.array]) -> Optional[tuple]:
    """(weight,) for the primitive's float32 product, where MLX would send this float32 weight's
    product to a BLAS that rounds a row by the number of rows (`blas.rounds_by_rows`: MKL, as
    `dflash serve` loads on Linux): a layer too small for a narrow copy (a router, a gate) must
    still give a token the same bits in a verify as in a decode step. Else None (MLX's product)."""
    if (weight is None or weight.dtype != mx.float32 or weight.ndim != 2 or backend() != "cpu"
            or not rounds_by_rows() or extension() is None):
        return None
    return (weight,)


def cpu_weight(layer: nn.Module, x: mx.array) -> Optional[tuple]:
    """The weight `layer(x)` is multiplied by in the primitive here (a plain linear layer, a float32
    input, on the CPU): the copy `add_narrow_copies` gave it, else `fixed_order_weight`; else None."""
    if type(layer) is not nn.Linear or x.dtype != mx.float32 or backend() != "cpu":
        return None
    return layer.get(NARROW_WEIGHT) or fixed_order_weight(layer.weight)


def add_narrow_copies(modules: list[nn.Module], min_parameters: int = MIN_PARAMETERS) -> int:
    """Give the plain linear layers in `modules` whose float32 weight has `min_parameters`+
    parameters the copy the primitive multiplies (`narrow_copy`), where it runs here; returns how
    many got one."""
    if backend() != "cpu":
        return 0
    layers = [layer for module in modules for _, layer in module.named_modules()
              if type(layer) is nn.Linear and NARROW_WEIGHT not in layer and layer.weight.dtype == mx.float32
              and layer.weight.size >= min_parameters]
    if not layers or extension() is None:  # (nothing to build for models without such layers)
        return 0
    copies = []
    for layer in layers:
        copy = narrow_copy(layer.weight)
        if copy is not None:
            setattr(layer, NARROW_WEIGHT, copy)
            copies.append(copy)
    mx.eval(copies)
    return len(copies)


def active_path() -> str:
    """What a decode step's projections use here (for `dflash doctor`)."""
    if backend() != "cpu":
        return "not used (MLX runs on a GPU)"
    if not cpu_supports():
        return "MLX's float32 product (the kernel needs x86-64 Linux with AVX2, FMA and F16C)"
    module = extension()
    if module is None:
        return "MLX's float32 product (the kernel did not build: is there a C++ compiler and CMake?)"
    smaller = ("; smaller float32 layers and heads in its float32 product, in a fixed order (this BLAS rounds by "
               "the row count)" if rounds_by_rows() else "")
    return (f"int8 or float16 copies in our MLX primitive ({module.__file__}) for projections of {MIN_PARAMETERS}+ "
            f"parameters in decode and verify{smaller}")
