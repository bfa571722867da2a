"""Attention of a verify or draft block (2..16 queries) over a long cache, behind the gate.

On CUDA, MLX sends such a block with an explicit mask and head_dim <= 128 to cuDNN's flash
attention, which parallelises over query tiles and heads only: 16 queries over a long cache get one
thread block per head, which made a verify at 32K cost several decode steps (docs/performance.md,
"Verify and draft blocks at long context").
Here the block is two batched GEMMs per KV head, with the query heads that share a KV head stacked
into one matrix (4 x 16 rows for Qwen3), so every key is read once and the GEMM has rows to use.
The keys may come in segments (a drafter's context buffer and its block): scores are computed per
segment, so the cache is never copied to concatenate it.

On the CPU (float32) every attention of a decode, verify or draft forward, one query or a block,
is MLX's own unfused sequence of ops (what its fused attention runs on the CPU) with the softmax in
our primitive (cpu_softmax.cpp; MLX's CPU `exp` made a long cache's attention mostly exps) and the
two products in ours too (cpu_attention.cpp; a fast BLAS rounds them by the number of rows). Decode
steps (`single_query`) take the same path as blocks, so a query gets the same bits either way,
whichever BLAS the process has.

On CUDA a target's decode step and verify block (one key segment, the cache's buffer) take our
kernel instead (attention_cuda.py, `KernelOptions.exact_attention`): a query gets the same bits
there whether it comes alone or in a block, whatever the buffer's length, which the stacked GEMMs
and MLX's fused attention do not promise each other. A drafter's blocks (two segments) take it too,
joined into one, while the context is small enough to copy (`joins_for_exact`); longer contexts go
to the stacked GEMMs (a drafter's rounding never changes the output).

Elsewhere (Metal, one query on CUDA with exact attention off, no mask) it is MLX's fused attention
over the concatenated keys.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from . import DEFAULT_KERNELS, KernelOptions, attention_cuda, backend, cpu_extension
from .cpu_head import default_threads

MAX_QUERIES = 16
# Above 128 as well: MLX runs head_dim 129..512 on its unfused path (scores as a bf16 GEMM, as here,
# but with each query head's GEMM reading the keys again), which stacking measured 10-25% faster at
# 256 (Qwen3.5); 512 is Gemma 4's global layers.
MAX_HEAD_DIM = 512


def buffer_mask(length: int, start: int, queries: int) -> mx.array:
    """The boolean mask [queries, length] of queries at positions start.. over a KV cache's whole
    buffer: each sees the keys up to its own position, never the buffer's unused or stale tail.
    Adapters attend over the whole buffer (it grows in steps of 256) so that shapes repeat across
    cycles: CUDA's cuDNN attention builds one graph per shape, compiled blocks trace once per shape."""
    return mx.arange(length)[None] <= mx.arange(start, start + queries)[:, None]


def path_for(q: mx.array, mask, kernels: KernelOptions = DEFAULT_KERNELS) -> str:
    """'stacked' (CUDA blocks), 'cpu' (the CPU, float32, our softmax) or 'fused' (MLX's own)."""
    L, D = q.shape[2], q.shape[3]
    boolean_mask = isinstance(mask, mx.array) and mask.dtype == mx.bool_  # not an additive one
    if kernels.block_attention and backend() == "cuda" and 1 < L <= MAX_QUERIES and boolean_mask and D <= MAX_HEAD_DIM:
        return "stacked"
    if (kernels.cpu_softmax and backend() == "cpu" and q.dtype == mx.float32 and not isinstance(mask, str)
            and cpu_extension.extension() is not None):
        return "cpu"
    return "fused"


def exact(q: mx.array, k, v, mask, kernels: KernelOptions = DEFAULT_KERNELS) -> bool:
    """Whether this attention (one key segment) goes through attention_cuda.py's kernel: on CUDA,
    with `exact_attention` on and shapes it takes."""
    return (kernels.exact_attention and backend() == "cuda" and isinstance(k, mx.array)
            and isinstance(v, mx.array) and attention_cuda.supported(q, k, v, mask, kernels.attention_chunk))


# A drafter's block joins its context and itself into one key segment for the exact kernel (two
# launches where the stacked GEMMs over the two take about ten, and two copies of the context) only
# while the context's keys are at most this many bytes: copying them twice a layer then costs the
# device less than the launches saved cost the host (8 MiB read and written is about 5 us at 3.3
# TB/s, a launch 4-5 us of host time on an H100). Longer contexts keep two segments, never copied.
# Measured at 1K context (the 270M drafter's 256 KiB: docs/performance.md, "Fewer launches in the
# cycle"); the bound itself is this estimate, not yet a measurement.
JOIN_MAX_BYTES = 8 << 20


def joins_for_exact(q: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array], mask,
                    kernels: KernelOptions = DEFAULT_KERNELS) -> bool:
    """Whether a block's key segments should be joined (`KernelOptions.drafter_exact_attention`):
    the exact kernel would take them joined, and the ones before the last are small enough to copy."""
    return (kernels.drafter_exact_attention and kernels.exact_attention and backend() == "cuda" and len(keys) > 1
            and sum(k.nbytes for k in keys[:-1]) <= JOIN_MAX_BYTES
            and attention_cuda.supported_segments(q, keys, values, mask, kernels.attention_chunk))


def attention(q: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array], scale: float, mask,
              kernels: KernelOptions = DEFAULT_KERNELS) -> mx.array:
    """Softmax attention of q [B, Hq, L, D] over the concatenation of key/value segments
    [B, Hkv, T_i, D]; `mask` (bool, [L, T], or [B, 1 or Hq, L, T] with T = sum T_i) says which
    keys a query sees."""
    if len(keys) == 1 and exact(q, keys[0], values[0], mask, kernels):
        return attention_cuda.attention(q, keys[0], values[0], scale, mask, kernels.tensor_core_attention,
                                        kernels.attention_chunk, kernels.attention_load_warps)
    path = path_for(q, mask, kernels)
    if path == "stacked":
        return stacked(q, keys, values, scale, mask)
    k = keys[0] if len(keys) == 1 else mx.concatenate(list(keys), axis=2)
    v = values[0] if len(values) == 1 else mx.concatenate(list(values), axis=2)
    if path == "cpu":
        return unfused_cpu(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def single_query(q: mx.array, k: mx.array, v: mx.array, cache, scale: float, mask,
                 kernels: KernelOptions = DEFAULT_KERNELS) -> mx.array:
    """A decode step's attention, one query over the keys it has: mlx-lm's own call, or the path
    blocks take on the CPU and on CUDA. A "causal" mask shows one query every key, as no mask does."""
    mask = None if isinstance(mask, str) else mask
    if exact(q, k, v, mask, kernels):
        return attention_cuda.attention(q, k, v, scale, mask, kernels.tensor_core_attention,
                                        kernels.attention_chunk, kernels.attention_load_warps)
    if path_for(q, mask, kernels) == "cpu":
        return unfused_cpu(q, k, v, scale, mask)
    return scaled_dot_product_attention(q, k, v, cache=cache, scale=scale, mask=mask)


def unfused_cpu(q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
    """The ops MLX's fused attention runs on the CPU (the same products, scale and masking, query
    heads grouped by KV head), with the softmax in our primitive (cpu_softmax.cpp) and, for up to
    MAX_QUERIES queries (decode, verify and draft blocks), the two products too (cpu_attention.cpp):
    each score and output one sum in a fixed order, where the BLAS's rounding depends on the number
    of rows. A prefill's hundreds of queries keep the BLAS's products (faster there; a prompt is
    prefilled the same way whether the generation speculates or not)."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    repeats = Hq // Hkv
    module = cpu_extension.extension()
    fixed_order = L <= MAX_QUERIES
    rows = (mx.array(scale, q.dtype) * q).reshape(B, Hkv, repeats * L, D)  # a KV head's query heads
    if fixed_order and k.shape[0] != B:
        k, v = mx.broadcast_to(k, (B, *k.shape[1:])), mx.broadcast_to(v, (B, *v.shape[1:]))
    scores = (module.attention_scores(rows, k, default_threads()) if fixed_order
              else rows @ k.swapaxes(-1, -2))
    if mask is not None:
        if repeats > 1:
            scores = scores.reshape(B, Hkv, repeats, L, -1)
            if mask.ndim >= 3:
                mask = (mx.expand_dims(mask, -3) if mask.shape[-3] == 1
                        else mask.reshape(*mask.shape[:-3], Hkv, repeats, *mask.shape[-2:]))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    probs = module.softmax(scores, default_threads()).reshape(B, Hkv, repeats * L, -1)
    out = module.attention_values(probs, v, default_threads()) if fixed_order else probs @ v
    return out.reshape(B, Hq, L, -1)


def stacked(q, keys, values, scale, mask) -> mx.array:
    """The same attention as MLX's unfused reference (scaled bf16 scores, fp32 softmax), with the
    query heads of each KV head stacked into the rows of one GEMM. Its scores are rounded to the
    input dtype before the softmax, as in that reference; cuDNN keeps them in fp32, so in bf16 a
    verify's attention now rounds a little differently from a decode step's (near-ties only)."""
    B, Hq, L, D = q.shape
    Hkv = keys[0].shape[1]
    rows = (q * mx.array(scale, q.dtype)).reshape(B, Hkv, Hq // Hkv * L, D)
    scores = [rows @ k.swapaxes(-1, -2) for k in keys]
    scores = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    scores = scores.reshape(B, Hkv, Hq // Hkv, L, -1)
    if mask.ndim == 4:  # [B or 1, 1 or Hq, L, T] -> [B or 1, 1 or Hkv, 1 or Hq // Hkv, L, T]
        mb = mask.shape[0]
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(mb, Hkv, Hq // Hkv, L, -1)
    scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, Hkv, Hq // Hkv * L, -1)
    out = None
    start = 0
    for v in values:
        part = probs[..., start : start + v.shape[2]] @ v
        out = part if out is None else out + part
        start += v.shape[2]
    return out.reshape(B, Hq, L, -1)


def active_path(kernels: KernelOptions = DEFAULT_KERNELS) -> str:
    """Which implementation a verify or draft block's attention uses here (for `dflash doctor`)."""
    if backend() == "cuda" and kernels.exact_attention:
        cores = " on tensor cores for bf16/fp16 head_dim 16-256" if kernels.tensor_core_attention else ""
        return (f"dflash's kernel for a target's 1-{attention_cuda.MAX_QUERIES} queries (head_dim in "
                f"{attention_cuda.HEAD_DIMS}, rows rounded alike{cores}); a drafter's blocks "
                + (f"there too up to a context of {JOIN_MAX_BYTES >> 20} MiB of keys, as stacked GEMMs beyond"
                   if kernels.drafter_exact_attention else "as stacked GEMMs"))
    if backend() == "cuda" and kernels.block_attention:
        return f"stacked GEMMs for 2-{MAX_QUERIES} queries with a mask (head_dim <= {MAX_HEAD_DIM}); MLX fused otherwise"
    if backend() == "cpu" and kernels.cpu_softmax and cpu_extension.extension() is not None:
        return "MLX's unfused ops with our CPU softmax and products (float32, decode and blocks)"
    return "MLX fused attention"
