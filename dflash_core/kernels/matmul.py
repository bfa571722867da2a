"""The weight products of decode and verify forwards (`x @ W.T` for a few rows), behind the gate.

Adapters call `linear(layer, x)` where mlx-lm would call `layer(x)`, `linears(group, x)` for
projections that share an input (one launch on the kernel's path), `gated_mlp(mlp, x, act)` for
its gated MLPs and `tied_lm_head(embedding, x)` for a tied head, each with the `KernelOptions` of
the adapter. On CUDA, products of at most 16 rows by 4-bit affine weights (`nn.QuantizedLinear`,
`nn.QuantizedEmbedding`) use our kernel (quantized_matmul_cuda.py), because MLX's CUDA quantized
matmul streams them at a fraction of the card's bandwidth; products of at most 32 rows by bf16
weights (`nn.Linear`, `nn.Embedding`) use our stream kernel (bf16_matmul_cuda.py): kernel-only it
matches MLX's GEMMs, but per call it costs the host less than MLX's cuBLASLt path, which made
forced DFlash cycles on the H200 3-22 % faster (docs/performance.md, "MLX's CUDA graphs and the
cycle"). Both kernels give a token's row the same bits whatever rows share the call, as the
lossless loop needs, and both have a gradient (`dflash train` sends drafter blocks through them).
Everything else, on every backend, is mlx-lm's own call, which is what tests compare the kernels
against. What also pays for bf16 on CUDA is one product for the projections that share an input
instead of one each (up to 2.5x for a verify's 16 rows with MLX's GEMM, which handles a 32-row
weight poorly): a `SharedInput` built at load puts their weights into one matrix, each layer's
weight becoming a view of its rows, so memory does not grow and mlx-lm's own calls (prefill) read
the same numbers.
"""

from __future__ import annotations

import functools
import itertools
from typing import Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from . import DEFAULT_KERNELS, KernelOptions, backend, bf16_matmul_cuda, cpu_linear, quantized_matmul_cuda


def _on_cuda(kernels: KernelOptions) -> bool:
    """Whether this module's CUDA paths (the 4-bit kernel, stacked GEMMs) are on here."""
    return kernels.cuda_matmul and backend() == "cuda"


class SharedInput:
    """Projections a forward multiplies by one input (q, k, v; gate and up), built once at load by
    whoever owns them (an adapter, the drafter) and handed to `linears`. On CUDA, plain linear
    layers (same K and dtype) get their weights stored as one matrix, each layer's `weight` a view
    of its rows, so that `linears` multiplies them in one GEMM. Memory stays the same; every other
    call of the layers sees the same numbers. Layers with a bias are left alone: nn.Linear adds it
    inside the GEMM (addmm), which rounds once. Elsewhere (and for quantized layers, which have the
    kernel's one launch already) it only holds the layers."""

    def __init__(self, layers: Sequence[nn.Module], kernels: KernelOptions = DEFAULT_KERNELS):
        self.layers = list(layers)
        self.weight: Optional[mx.array] = None  # [sum of N, K]: the layers' weights, one after another
        self.views: tuple = ()  # each layer's weight as stacked, a view of `weight`
        self.splits: list[int] = []  # where each layer's output columns start, after the first
        if _on_cuda(kernels) and _stackable(self.layers):
            self._stack()

    @property
    def stacked(self) -> bool:
        return self.weight is not None

    def _stack(self) -> None:
        weights = [layer.weight for layer in self.layers]
        stacked = mx.concatenate(weights)
        starts = [0, *itertools.accumulate(w.shape[0] for w in weights)]
        for layer, start, end in zip(self.layers, starts, starts[1:]):
            layer.weight = stacked[start:end]
        self.views = tuple(layer.weight for layer in self.layers)
        mx.eval(stacked, self.views)
        self.weight, self.splits = stacked, starts[1:-1]

    def products(self, x: mx.array, stream: bool = False, parts: bool = True) -> Optional[list[mx.array]]:
        """The layers' outputs from one GEMM, if they were stacked and still hold their views."""
        if self.weight is None:
            return None
        if not all(view is layer.weight for view, layer in zip(self.views, self.layers)):
            # Weights replaced since (new weights loaded, or traced ones in training): let the old
            # matrix go.
            self.weight, self.views, self.splits = None, (), []
            return None
        rows = x.size // x.shape[-1]
        if parts and stream and bf16_matmul_cuda.supported(rows, x, self.weight) and bf16_matmul_cuda.parts_supported(
                self.weight, self.splits):
            # Each layer's output an array of its own: columns of one product would be copied by the
            # reshapes after them (a launch each, a verify's three a layer).
            ys = _stream_parts(tuple(self.splits))(x.reshape(rows, x.shape[-1]), self.weight)
            return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]
        return mx.split(_bf16_product(x, self.weight, stream), self.splits, axis=-1)


def _stackable(layers: list[nn.Module]) -> bool:
    # Quantized layers have the kernel (one launch already); plain ones only, without a bias.
    if len(layers) < 2 or not all(type(layer) is nn.Linear and "bias" not in layer for layer in layers):
        return False
    return len({(layer.weight.shape[1], layer.weight.dtype) for layer in layers}) == 1


Group = Union[Sequence[nn.Module], SharedInput]


def _stacked_products(group: Group, x: mx.array, stream: bool = False, parts: bool = True) -> Optional[list[mx.array]]:
    """The group's outputs from one GEMM, if it is a SharedInput whose weights were stacked."""
    return group.products(x, stream, parts) if isinstance(group, SharedInput) else None


def _bf16_product(x: mx.array, weight: mx.array, stream: bool) -> mx.array:
    """`x @ weight.T`, through the stream kernel where `stream` asks for it and it takes the shapes."""
    if stream and bf16_matmul_cuda.supported(x.size // x.shape[-1], x, weight):
        return _stream_product()(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    return x @ weight.T


@functools.cache
def _stream_product():
    """The stream kernel as a differentiable function of x and the weight: `dflash train` sends
    drafter blocks through the drafter's own projections (trained) and the target's head (frozen)."""

    @mx.custom_function
    def product(x, weight):
        return bf16_matmul_cuda.matmul_stream(x, weight)

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, weight = primals
        return (cotangent @ weight).astype(x.dtype), (cotangent.T @ x).astype(weight.dtype)

    return product


@functools.cache
def _stream_parts(splits: tuple[int, ...]):
    """The stream kernel's split outputs (`matmul_stream_parts`) as a differentiable function of x
    and the stacked weight, as `_stream_product` is for one output."""

    @mx.custom_function
    def products(x, weight):
        return bf16_matmul_cuda.matmul_stream_parts(x, weight, splits)

    @products.vjp
    def products_vjp(primals, cotangents, outputs):
        x, weight = primals
        cotangent = mx.concatenate(list(cotangents), axis=-1)
        return (cotangent @ weight).astype(x.dtype), (cotangent.T @ x).astype(weight.dtype)

    return products


def _stream(kernels: KernelOptions) -> bool:
    return kernels.bf16_stream and _on_cuda(kernels)


def path_for(layer: nn.Module, x: mx.array, kernels: KernelOptions = DEFAULT_KERNELS) -> str:
    """'cuda' where `layer`'s product with `x` runs through our 4-bit kernel, 'stream' through our
    bf16 stream kernel, 'cpu' where through our CPU primitive for narrow copies of float32 weights
    (cpu_linear.py), else 'mlx'."""
    if kernels.cpu_narrow_linears and cpu_linear.cpu_weight(layer, x) is not None:
        return "cpu"
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if _stream(kernels) and type(layer) in (nn.Linear, nn.Embedding) and bf16_matmul_cuda.supported(
            rows, x, layer.weight):
        return "stream"
    if not (_on_cuda(kernels) and isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))):
        return "mlx"
    ok = "biases" in layer and quantized_matmul_cuda.supported(
        rows, x, layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits, getattr(layer, "mode", "affine"))
    return "cuda" if ok else "mlx"


@functools.cache
def _kernel_product(group_size: int):
    """The kernel as a differentiable function of x: `dflash train` may send 16 rows of a drafter
    block through a 4-bit target's LM head. The target is frozen, so its arrays get zeros."""

    @mx.custom_function
    def product(x, weights):
        return quantized_matmul_cuda.quantized_matmuls_cuda(x, weights, group_size)

    @product.vjp
    def product_vjp(primals, cotangents, outputs):
        x, weights = primals
        dx = sum(mx.quantized_matmul(dy, w, scales, biases, transpose=False, group_size=group_size, bits=4)
                 for dy, (w, scales, biases) in zip(cotangents, weights))
        return dx.astype(x.dtype), [tuple(mx.zeros_like(a) for a in weight) for weight in weights]

    return product


def _quantized_products(layers: list[nn.Module], x: mx.array) -> list[mx.array]:
    rows = x.reshape(-1, x.shape[-1])
    weights = [(layer.weight, layer.scales, layer.biases) for layer in layers]
    ys = _kernel_product(layers[0].group_size)(rows, weights)
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys]


def linears(group: Group, x: mx.array, kernels: KernelOptions = DEFAULT_KERNELS) -> list[mx.array]:
    """`[layer(x) for layer in group]`, with the layers the kernel takes (by group size) in one
    launch, or bf16 layers stacked at load (a `SharedInput`) in one GEMM: a launch costs about what
    streaming a small weight does (q, k, v; gate and up)."""
    layers = group.layers if isinstance(group, SharedInput) else list(group)
    fused = kernels.one_launch_per_input
    if fused and len(layers) > 1 and _on_cuda(kernels):
        stacked = _stacked_products(group, x, _stream(kernels), kernels.stream_parts)
        if stacked is not None:
            return stacked
    ys = [None] * len(layers)
    launches = {}
    for i, layer in enumerate(layers):
        path = path_for(layer, x, kernels)
        if path == "cuda":
            launches.setdefault(layer.group_size if fused else -1 - i, []).append(i)
        elif path == "cpu":
            y = cpu_linear.narrow_linear(x, cpu_linear.cpu_weight(layer, x))
            ys[i] = y + layer.bias if "bias" in layer else y
        elif path == "stream":
            y = _bf16_product(x, layer.weight, True)
            ys[i] = y + layer.bias if "bias" in layer else y
        else:
            ys[i] = layer(x)
    for members in launches.values():
        for i, y in zip(members, _quantized_products([layers[i] for i in members], x)):
            ys[i] = y + layers[i].bias if "bias" in layers[i] else y
    return ys


def linear(layer: nn.Module, x: mx.array, kernels: KernelOptions = DEFAULT_KERNELS) -> mx.array:
    """`layer(x)`, through the 4-bit small-M kernel or the CPU primitive where it runs."""
    return linears([layer], x, kernels)[0]


def tied_lm_head(embedding: nn.Module, x: mx.array, kernels: KernelOptions = DEFAULT_KERNELS) -> mx.array:
    """`embedding.as_linear(x)`, through the kernel for a 4-bit embedding where it runs."""
    path = path_for(embedding, x, kernels)
    if path == "cuda":
        return _quantized_products([embedding], x)[0]
    if path == "stream":
        return _bf16_product(x, embedding.weight, True)
    return embedding.as_linear(x)


def is_gated_mlp(mlp: nn.Module) -> bool:
    """mlx-lm's gated MLP (gate, up and down projections), not an MoE block."""
    return all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))


def is_sparse_moe(mlp: nn.Module) -> bool:
    """mlx-lm's Qwen3-Next MoE block (Qwen3.5's), run by `sparse_moe` here: on the CPU only, where a
    fast BLAS would round its router and shared expert by the row count. Elsewhere the module's own
    call, as before (on a GPU a verify and a decode step round differently anyway: README)."""
    return backend() == "cpu" and all(
        hasattr(mlp, name) for name in ("gate", "switch_mlp", "shared_expert", "shared_expert_gate"))


def sparse_moe(mlp: nn.Module, x: mx.array, activation, kernels: KernelOptions = DEFAULT_KERNELS,
               gate_up: Optional[SharedInput] = None) -> mx.array:
    """mlx-lm's Qwen3-Next MoE block with its router and shared expert through `linears` (`gate_up`:
    the shared expert's gate and up as built at load), so that on the CPU a token's routing and
    shared expert have the same bits in a verify as in a decode step (kernels/cpu_linear.py). The
    experts stay mlx-lm's: MLX's gathered products are per token."""
    gates = mx.softmax(linear(mlp.gate, x, kernels), axis=-1, precise=True)
    chosen = mx.stop_gradient(mx.argpartition(gates, kth=-mlp.top_k, axis=-1)[..., -mlp.top_k:])
    scores = mx.take_along_axis(gates, chosen, axis=-1)
    if mlp.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    y = (mlp.switch_mlp(x, chosen) * scores[..., None]).sum(axis=-2)
    shared = gated_mlp(mlp.shared_expert, x, activation, kernels, gate_up)
    y = y + mx.sigmoid(linear(mlp.shared_expert_gate, x, kernels)) * shared
    group = getattr(mlp, "sharding_group", None)  # experts split over processes (sharding.py)
    return y if group is None else mx.distributed.all_sum(y, group=group)


def gated_mlp(mlp: nn.Module, x: mx.array, activation, kernels: KernelOptions = DEFAULT_KERNELS,
              gate_up: Optional[SharedInput] = None) -> mx.array:
    """mlx-lm's gated MLP `down(activation(gate(x), up(x)))` (activation: mlx-lm's own `swiglu` or
    `geglu`) with its projections through `linears` (`gate_up`: its gate and up as built at load);
    Qwen3.5's MoE block is `sparse_moe`, other feed-forwards the module's own call."""
    if is_sparse_moe(mlp):
        return sparse_moe(mlp, x, activation, kernels, gate_up)
    if not is_gated_mlp(mlp):
        return mlp(x)
    gate, up = linears(gate_up if gate_up is not None else [mlp.gate_proj, mlp.up_proj], x, kernels)
    return linear(mlp.down_proj, activation(gate, up), kernels)


def active_path(kernels: KernelOptions = DEFAULT_KERNELS) -> str:
    """Which implementation small-M weight products use here (for `dflash doctor`)."""
    if _on_cuda(kernels):
        bf16 = "dflash stream kernel for bf16 weights and <= 32 rows" if kernels.bf16_stream else "MLX's GEMM for bf16"
        return (f"dflash CUDA kernel for 4-bit affine weights and <= 16 rows; {bf16}; MLX otherwise, with bf16 "
                "projections that share an input stacked into one product")
    return "MLX matmul"
