"""Micro-benchmarks of the pieces a DFlash cycle is made of, on the accelerator.

- the gated delta recurrence: our kernel against the pure-MLX path, T = 1, 16 and prefill sizes;
- attention of 1 and 16 queries over long caches, head_dim 256 (Qwen3.5) and 512 (Gemma 4 global);
- weight streaming of small-M matmuls (M = 1..16) in bf16 and 4-bit, against a plain copy;
- the tensor-core small-M matmul experiment (small_m_matmul_cuda.py): exactness against MLX's
  matmul, row invariance, and streaming per variant and block shape against MLX's GEMM;
- the 4-bit small-M matmul (dflash_core/kernels/quantized_matmul_cuda.py): exactness against a
  float32 product and MLX's quantized matmul, row invariance, and streaming per launch shape
  against MLX's quantized matmul at Qwen3.5-9B's projection shapes;
- the same kernel with the projections that share an input in one launch, against a launch each,
  and the same groups in bf16 through MLX's GEMM, stacked into one matrix or not;
- a verify block's attention (16 queries, head_dim 128 and 256) over long caches: MLX's fused
  path with the engine's mask against the stacked-GEMM path of dflash_core/kernels/attention.py;
- GatedDeltaNet's depthwise conv for a decode step and a verify block;
- a verify's KV writes followed by a rollback (keep 16 or 7 tokens) at 1K and 32K context;
- MLX's bf16 GEMM at batched-verify row counts (up to 128) and the recurrence for 1 and 8 rows.

    python benchmarks/gpu_kernels.py --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import small_m_matmul_cuda as matmul_cuda  # noqa: E402  (benchmarks/, an experiment)

from dflash_core.kernels import attention as block_attention  # noqa: E402
from dflash_core.kernels import backend  # noqa: E402
from dflash_core.kernels import gated_delta as gd  # noqa: E402
from dflash_core.kernels import quantized_matmul_cuda as q4  # noqa: E402


def bench(fn, warmup=3, iters=20) -> float:
    """Seconds per call; fn returns the arrays to evaluate."""
    for _ in range(warmup):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - start) / iters


def gated_delta_rows():
    rows = []
    B, Hk, Hv, Dk, Dv = 1, 16, 32, 128, 128  # Qwen3.5-9B's linear attention
    for T in (1, 16, 2048, 8192):
        q = (mx.random.normal((B, T, Hk, Dk)) / Dk**0.5).astype(mx.bfloat16)
        k = (mx.random.normal((B, T, Hk, Dk)) / Dk**0.5).astype(mx.bfloat16)
        v = mx.random.normal((B, T, Hv, Dv)).astype(mx.bfloat16)
        g = mx.exp(-mx.random.uniform(0.0, 0.5, (B, T, Hv)))
        beta = mx.sigmoid(mx.random.normal((B, T, Hv))).astype(mx.bfloat16)
        state = mx.zeros((B, Hv, Dv, Dk))
        mx.eval(q, k, v, g, beta, state)
        row = {"T": T, "path": gd.path_for(q, v, g)}
        row["kernel_ms"] = bench(lambda: gd.gated_delta(q, k, v, g, beta, state), iters=5 if T > 1000 else 20) * 1e3
        if T <= 2048:
            row["reference_ms"] = bench(lambda: gd.reference(q, k, v, g, beta, state), warmup=1,
                                        iters=2 if T > 1000 else 10) * 1e3
            y, s = gd.gated_delta(q, k, v, g, beta, state)
            y_ref, s_ref = gd.reference(q, k, v, g, beta, state)
            row["max_abs_diff_state"] = mx.abs(s - s_ref).max().item()
        row["tokens_per_s"] = T / row["kernel_ms"] * 1e3
        rows.append(row)
        print(json.dumps({"gated_delta": row}), flush=True)
    return rows


def random_kv(kv_heads, keys, dim):
    """A bf16 cache's keys and values [1, kv_heads, keys, dim]."""
    return tuple(mx.random.normal((1, kv_heads, keys, dim)).astype(mx.bfloat16) for _ in range(2))


def attention_rows():
    rows = []
    for label, heads, kv_heads, dim in (("qwen3.5 hd256", 16, 4, 256), ("gemma4 global hd512", 32, 4, 512)):
        for keys in (1024, 8192, 32768):
            k, v = random_kv(kv_heads, keys, dim)
            mx.eval(k, v)
            row = {"shape": label, "keys": keys}
            for L in (1, 16):
                q = mx.random.normal((1, heads, L, dim)).astype(mx.bfloat16)
                mask = None if L == 1 else "causal"
                row[f"q{L}_ms"] = bench(lambda: mx.fast.scaled_dot_product_attention(
                    q, k, v, scale=dim**-0.5, mask=mask)) * 1e3
            kv_bytes = 2 * k.nbytes
            row["q1_tb_s"] = kv_bytes / row["q1_ms"] / 1e9
            row["q16_tb_s"] = kv_bytes / row["q16_ms"] / 1e9
            rows.append(row)
            print(json.dumps({"attention": row}), flush=True)
    return rows


def streaming_rows():
    rows = []
    K, N, layers = 4096, 12288, 8  # eight 4096x12288 weights: 800 MB in bf16, far past L2
    weights = [mx.random.normal((N, K)).astype(mx.bfloat16) for _ in range(layers)]
    quantized = [mx.quantize(w, group_size=64, bits=4) for w in weights]
    mx.eval(weights, quantized)
    bf16_bytes = sum(w.nbytes for w in weights)
    q4_bytes = sum(sum(a.nbytes for a in q) for q in quantized)
    src = mx.zeros((bf16_bytes // 2,), mx.bfloat16)
    copy_s = bench(lambda: [src + 0])  # read + write
    rows.append({"op": "copy (read+write)", "tb_s": 2 * src.nbytes / copy_s / 1e12})
    for M in (1, 2, 4, 8, 16):
        x = mx.random.normal((M, K)).astype(mx.bfloat16)
        t = bench(lambda: [x @ w.T for w in weights])
        tq = bench(lambda: [mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4) for q in quantized])
        # The same product written other ways, in case another kernel streams better.
        t_nn = bench(lambda: [(w @ x.T).T for w in weights])
        x32 = mx.concatenate([x, mx.zeros((32 - M, K), x.dtype)]) if M < 32 else x
        t_pad = bench(lambda: [(x32 @ w.T)[:M] for w in weights])
        row = {"M": M, "bf16_tb_s": bf16_bytes / t / 1e12, "q4_tb_s": q4_bytes / tq / 1e12,
               "bf16_w_x_tb_s": bf16_bytes / t_nn / 1e12, "bf16_pad32_tb_s": bf16_bytes / t_pad / 1e12,
               "bf16_ms_per_layer": t / layers * 1e3, "q4_ms_per_layer": tq / layers * 1e3}
        rows.append(row)
        print(json.dumps({"streaming": row}), flush=True)
    return rows


# (variant, warps per block, 16-row tiles per warp, pipeline stages or unroll)
MATMUL_CONFIGS = [("direct", 4, 1, 4), ("direct", 8, 1, 4), ("pipelined", 1, 1, 4), ("pipelined", 1, 1, 8),
                  ("pipelined", 2, 1, 2), ("pipelined", 2, 1, 4), ("pipelined", 4, 1, 2), ("pipelined", 2, 2, 2),
                  ("pipelined", 1, 2, 4)]


def matmul_rows():
    rows = []
    # Exactness: every M against MLX's GEMM (fp32 accumulation both, different order), and each
    # token's row bit-identical whether multiplied alone or with the others.
    for N, K in ((4096, 4096), (12288, 4096), (4096, 12288), (1024, 5376)):
        w = (mx.random.normal((N, K)) / K**0.5).astype(mx.bfloat16)
        x16 = mx.random.normal((16, K)).astype(mx.bfloat16)
        alone = matmul_cuda.matmul_cuda(x16[:1], w)
        for M in range(1, 17):
            x = x16[:M]
            ours = matmul_cuda.matmul_cuda(x, w).astype(mx.float32)
            ref = (x.astype(mx.float32) @ w.astype(mx.float32).T)
            row = {"N": N, "K": K, "M": M,
                   "max_abs_err_vs_fp32": mx.abs(ours - ref).max().item(),
                   "mlx_max_abs_err_vs_fp32": mx.abs((x @ w.T).astype(mx.float32) - ref).max().item(),
                   "row0_identical_to_alone": bool(mx.array_equal(ours[:1], alone.astype(mx.float32)).item())}
            rows.append(row)
        last = rows[-16:]
        print(json.dumps({"matmul_exact": {
            "N": N, "K": K, "max_abs_err_vs_fp32": max(r["max_abs_err_vs_fp32"] for r in last),
            "mlx_max_abs_err_vs_fp32": max(r["mlx_max_abs_err_vs_fp32"] for r in last),
            "row_invariant": all(r["row0_identical_to_alone"] for r in last)}}), flush=True)
    # Streaming: about 800 MB of weights per shape (far past L2), each kernel variant and MLX's GEMM.
    for N, K in ((12288, 4096), (4096, 12288), (4096, 4096)):
        layers = max(2, int(800e6 // (2 * N * K)))
        weights = [mx.random.normal((N, K)).astype(mx.bfloat16) for _ in range(layers)]
        mx.eval(weights)
        nbytes = sum(w.nbytes for w in weights)
        for M in (1, 4, 16):
            x = mx.random.normal((M, K)).astype(mx.bfloat16)
            row = {"N": N, "K": K, "M": M, "mlx_tb_s": nbytes / bench(lambda: [x @ w.T for w in weights]) / 1e12}
            for variant, warps, row_tiles, depth in MATMUL_CONFIGS:
                t = bench(lambda: [matmul_cuda.matmul_cuda(x, w, variant, warps, row_tiles, depth) for w in weights])
                row[f"{variant}_w{warps}_m{row_tiles}_d{depth}_tb_s"] = nbytes / t / 1e12
            rows.append(row)
            print(json.dumps({"matmul_streaming": row}), flush=True)
    return rows


# (warps per block splitting K, 16-row tiles per warp, 128-k chunks loaded ahead)
Q4_SHAPES = [(1, 1, 2), (2, 1, 1), (4, 1, 1), (4, 1, 2), (8, 1, 1), (8, 1, 2), (2, 2, 1), (4, 2, 1), (4, 2, 2),
             (8, 2, 1), (2, 4, 1), (16, 1, 1)]


def q4_matmul_rows():
    rows = []
    # Per-launch cost: a product so small that only the launch and its host work are measured.
    tiny = mx.quantize(mx.random.normal((16, 128)).astype(mx.bfloat16), group_size=64, bits=4)
    x1 = mx.random.normal((1, 128)).astype(mx.bfloat16)
    calls = 200
    row = {"op": "launch, 16 x 128 weight, M = 1, per call", "calls": calls,
           "mlx_us": bench(lambda: [mx.quantized_matmul(x1, *tiny, transpose=True, group_size=64, bits=4)
                                    for _ in range(calls)]) / calls * 1e6,
           "ours_us": bench(lambda: [q4.quantized_matmul_cuda(x1, *tiny, 64) for _ in range(calls)]) / calls * 1e6}
    rows.append(row)
    print(json.dumps({"q4_launch": row}), flush=True)
    # Qwen3.5-9B: LM head (one 0.57 GB launch), in_proj_qkv, MLP gate/up, MLP down, in_proj_z and
    # o_proj, k/v, in_proj_a/b.
    for N, K in ((248320, 4096), (8192, 4096), (12288, 4096), (4096, 12288), (4096, 4096), (1024, 4096),
                 (32, 4096)):
        w = (mx.random.normal((N, K)) / K**0.5).astype(mx.bfloat16)
        q = mx.quantize(w, group_size=64, bits=4)
        x16 = mx.random.normal((16, K)).astype(mx.bfloat16)
        dq = mx.dequantize(*q, group_size=64, bits=4).astype(mx.float32)
        block = q4.quantized_matmul_cuda(x16, *q, 64)
        exact = {"N": N, "K": K, "launch": q4.launch_shape((N,), K), "max_abs_err_vs_fp32": 0.0,
                 "mlx_max_abs_err_vs_fp32": 0.0, "row_invariant": True}
        for M in (1, 2, 5, 8, 9, 16):
            x = x16[:M]
            ref = x.astype(mx.float32) @ dq.T
            ours = q4.quantized_matmul_cuda(x, *q, 64)
            mlx_own = mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4)
            exact["max_abs_err_vs_fp32"] = max(exact["max_abs_err_vs_fp32"], mx.abs(ours.astype(mx.float32) - ref).max().item())
            exact["mlx_max_abs_err_vs_fp32"] = max(exact["mlx_max_abs_err_vs_fp32"],
                                                   mx.abs(mlx_own.astype(mx.float32) - ref).max().item())
            exact["row_invariant"] &= bool(mx.array_equal(ours, block[:M]).item())
        print(json.dumps({"q4_exact": exact}), flush=True)
        del w, dq
        # Streaming: about 800 MB of 4-bit weights (with scales and biases) per shape, past L2.
        layers = max(1, min(64, int(800e6 // (N * K * 0.5625))))
        weights = [mx.quantize((mx.random.normal((N, K)) / K**0.5).astype(mx.bfloat16), group_size=64, bits=4)
                   for _ in range(layers)]
        mx.eval(weights)
        nbytes = sum(sum(a.nbytes for a in q) for q in weights)
        for M in (1, 4, 16):
            x = x16[:M]
            row = {**exact, "M": M, "mlx_tb_s": nbytes / bench(
                lambda: [mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4) for q in weights]) / 1e12,
                "default_tb_s": nbytes / bench(lambda: [q4.quantized_matmul_cuda(x, *q, 64) for q in weights]) / 1e12}
            for shape in Q4_SHAPES:
                nw, mt, u = shape
                if N % (16 * mt) == 0 and nw <= K // 128:
                    t = bench(lambda: [q4.quantized_matmul_cuda(x, *q, 64, shape) for q in weights])
                    row[f"w{nw}_m{mt}_u{u}_tb_s"] = nbytes / t / 1e12
            rows.append(row)
            print(json.dumps({"q4_streaming": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}}),
                  flush=True)
        weights = None  # free them before the next shape
        mx.clear_cache()
    return rows


# Qwen3.5-9B's projections that share an input: a GatedDeltaNet layer's qkv, z, b, a; an
# attention layer's q (with its gate), k, v; the MLP's gate and up.
Q4_SHARED_INPUT = {"gdn in_proj qkv/z/b/a": ((8192, 4096, 32, 32), 4096),
                   "attention q/k/v": ((8192, 1024, 1024), 4096),
                   "mlp gate/up": ((12288, 12288), 4096)}


def q4_fused_rows():
    """One launch for the weights that share an input against one launch per weight, over 32
    layers' worth of distinct weights (as a forward streams them), ms per layer."""
    rows = []
    for label, (ns, K) in Q4_SHARED_INPUT.items():
        layers = [[mx.quantize((mx.random.normal((n, K)) / K**0.5).astype(mx.bfloat16), group_size=64, bits=4)
                   for n in ns] for _ in range(32)]
        mx.eval(layers)
        nbytes = sum(a.nbytes for layer in layers for q in layer for a in q)
        for M in (1, 16):
            x = mx.random.normal((M, K)).astype(mx.bfloat16)
            apart = bench(lambda: [y for layer in layers for q in layer for y in [q4.quantized_matmul_cuda(x, *q, 64)]])
            fused = bench(lambda: [y for layer in layers for y in q4.quantized_matmuls_cuda(x, layer, 64)])
            mlx_own = bench(lambda: [mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4)
                                     for layer in layers for q in layer])
            same = all(mx.array_equal(a, b).item() for a, b in zip(
                q4.quantized_matmuls_cuda(x, layers[0], 64), [q4.quantized_matmul_cuda(x, *q, 64) for q in layers[0]]))
            row = {"weights": label, "N": list(ns), "K": K, "M": M, "launch_apart": [q4.launch_shape((n,), K, M) for n in ns],
                   "launch_fused": q4.launch_shape(ns, K, M), "ms_per_layer_apart": apart / 32 * 1e3,
                   "ms_per_layer_fused": fused / 32 * 1e3, "ms_per_layer_mlx": mlx_own / 32 * 1e3,
                   "tb_s_apart": nbytes / apart / 1e12, "tb_s_fused": nbytes / fused / 1e12, "tb_s_mlx": nbytes / mlx_own / 1e12,
                   "fused_bit_identical_to_apart": same}
            rows.append(row)
            print(json.dumps({"q4_fused": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}}),
                  flush=True)
        layers = None
        mx.clear_cache()
    return rows


def bf16_stacked_rows():
    """The same groups in bf16 through MLX's GEMM: a matmul per weight against one matmul by the
    weights stacked into one matrix (the output split into views), ms per layer over 32 layers'
    worth of distinct weights. Measures whether stacking bf16 projections at load would pay."""
    rows = []
    for label, (ns, K) in Q4_SHARED_INPUT.items():
        layers = [[(mx.random.normal((n, K)) / K**0.5).astype(mx.bfloat16) for n in ns] for _ in range(32)]
        stacked = [mx.concatenate(layer) for layer in layers]
        mx.eval(layers, stacked)
        nbytes = sum(w.nbytes for w in stacked)
        splits = [sum(ns[: i + 1]) for i in range(len(ns) - 1)]
        for M in (1, 16):
            x = mx.random.normal((M, K)).astype(mx.bfloat16)
            apart = bench(lambda: [x @ w.T for layer in layers for w in layer])
            one = bench(lambda: [y for w in stacked for y in mx.split(x @ w.T, splits, axis=-1)])
            row = {"weights": label, "N": list(ns), "K": K, "M": M, "ms_per_layer_apart": apart / 32 * 1e3,
                   "ms_per_layer_stacked": one / 32 * 1e3, "tb_s_apart": nbytes / apart / 1e12,
                   "tb_s_stacked": nbytes / one / 1e12}
            rows.append(row)
            print(json.dumps({"bf16_stacked": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}}),
                  flush=True)
        layers = stacked = None
        mx.clear_cache()
    return rows


def block_attention_rows():
    rows = []
    for label, heads, kv_heads, dim in (("qwen3 hd128", 32, 8, 128), ("qwen3.5 hd256", 16, 4, 256)):
        for keys in (1024, 8192, 32768):
            k, v = random_kv(kv_heads, keys, dim)
            q = mx.random.normal((1, heads, 16, dim)).astype(mx.bfloat16)
            start = keys - 200  # the engine's verify mask: a buffer whose tail is unused
            mask = mx.arange(keys)[None] <= mx.arange(start, start + 16)[:, None]
            mx.eval(k, v, q, mask)
            scale = dim**-0.5
            fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
            ours = block_attention.stacked(q, [k], [v], scale, mask)
            row = {"shape": label, "keys": keys,
                   "fused_masked_ms": bench(lambda: [mx.fast.scaled_dot_product_attention(
                       q, k, v, scale=scale, mask=mask)]) * 1e3,
                   "stacked_ms": bench(lambda: [block_attention.stacked(q, [k], [v], scale, mask)]) * 1e3,
                   "q1_fused_ms": bench(lambda: [mx.fast.scaled_dot_product_attention(
                       q[:, :, :1], k[:, :, :start + 1], v[:, :, :start + 1], scale=scale)]) * 1e3,
                   "max_abs_diff": mx.abs(fused.astype(mx.float32) - ours.astype(mx.float32)).max().item()}
            rows.append(row)
            print(json.dumps({"block_attention": row}), flush=True)
    return rows


def kv_rollback_rows():
    """A verify's KV writes followed by a rollback that keeps 16 or 7 of the 16 tokens, over 36
    layers of mlx-lm's KVCache at 32K (Qwen3-8B's 8 KV heads x 128): does a trim make the next
    write cost O(context)?"""
    from mlx_lm.models.cache import KVCache

    rows = []
    layers, kv_heads, dim = 36, 8, 128
    for context in (1024, 32768):
        for keep in (16, 7):
            caches = []
            for _ in range(layers):
                c = KVCache()
                c.update_and_fetch(*(mx.random.normal((1, kv_heads, context, dim)).astype(mx.bfloat16),) * 2)
                caches.append(c)
            mx.eval([(c.keys, c.values) for c in caches])
            block = mx.random.normal((1, kv_heads, 16, dim)).astype(mx.bfloat16)

            def step():
                outs = []
                for c in caches:
                    k, v = c.update_and_fetch(block, block)
                    outs.append(k[..., -1, :].sum() + v[..., -1, :].sum())
                    c.trim(16 - keep)
                return outs + [a for c in caches for a in (c.keys, c.values)]

            row = {"context": context, "keep": keep, "ms": bench(step, warmup=3, iters=40) * 1e3}
            rows.append(row)
            print(json.dumps({"kv_rollback": row}), flush=True)
    return rows


def conv_rows():
    rows = []
    channels, kernel = 2 * 16 * 128 + 32 * 128, 4  # Qwen3.5-9B: conv over q, k and v
    conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)
    conv.set_dtype(mx.bfloat16)
    mx.eval(conv.parameters())
    for T in (1, 16):
        x = mx.random.normal((1, T + kernel - 1, channels)).astype(mx.bfloat16)
        w = conv.weight  # [C, K, 1]
        t_conv = bench(lambda: [conv(x)])
        t_shift = bench(lambda: [sum(x[:, j: j + T] * w[:, j, 0] for j in range(kernel))])
        rows.append({"T": T, "conv1d_ms": t_conv * 1e3, "shifted_sum_ms": t_shift * 1e3})
        print(json.dumps({"conv": rows[-1]}), flush=True)
    return rows


def batch_gemm_rows():
    """MLX's bf16 GEMM at the row counts batched verifies reach (8 rows x 16 tokens = 128), for
    Qwen3.5-9B's stacked projections and its LM head, ms per layer over 32 layers' worth of distinct
    weights; and the gated delta kernel for 1 and 8 rows of 16 steps, with and without the state
    after every step. Says how a batched verify's cost splits between the weights and the rest."""
    rows = []
    shapes = {"gdn in_proj (stacked)": (8192 + 4096 + 64, 4096), "attention qkv (stacked)": (8192 + 2048, 4096),
              "mlp gate+up (stacked)": (24576, 4096), "mlp down": (4096, 12288), "out_proj": (4096, 4096)}
    for label, (N, K) in shapes.items():
        layers = [(mx.random.normal((N, K)) / K**0.5).astype(mx.bfloat16) for _ in range(16)]
        mx.eval(layers)
        nbytes = sum(w.nbytes for w in layers)
        for M in (1, 16, 32, 64, 128):
            x = mx.random.normal((1, M, K)).astype(mx.bfloat16)
            t = bench(lambda: [x @ w.T for w in layers])
            row = {"weights": label, "N": N, "K": K, "M": M, "ms_per_layer": t / len(layers) * 1e3,
                   "tb_s": nbytes / t / 1e12}
            rows.append(row)
            print(json.dumps({"batch_gemm": row}), flush=True)
        layers = None
        mx.clear_cache()
    head = (mx.random.normal((248320, 4096)) / 64).astype(mx.bfloat16)
    mx.eval(head)
    for M in (1, 16, 64, 128):
        x = mx.random.normal((1, M, 4096)).astype(mx.bfloat16)
        t = bench(lambda: [x @ head.T])
        row = {"weights": "lm head", "N": 248320, "K": 4096, "M": M, "ms_per_layer": t * 1e3,
               "tb_s": head.nbytes / t / 1e12}
        rows.append(row)
        print(json.dumps({"batch_gemm": row}), flush=True)
    head = None
    Hk, Hv, Dk, Dv, T = 16, 32, 128, 128, 16
    for B in (1, 8):
        q = (mx.random.normal((B, T, Hk, Dk)) / Dk**0.5).astype(mx.bfloat16)
        k = (mx.random.normal((B, T, Hk, Dk)) / Dk**0.5).astype(mx.bfloat16)
        v = mx.random.normal((B, T, Hv, Dv)).astype(mx.bfloat16)
        g = mx.exp(-mx.random.uniform(0.0, 0.5, (B, T, Hv)))
        beta = mx.sigmoid(mx.random.normal((B, T, Hv))).astype(mx.bfloat16)
        states = [mx.zeros((B, Hv, Dv, Dk)) + i for i in range(24)]
        mx.eval(q, k, v, g, beta, states)
        plain = bench(lambda: [gd.gated_delta(q, k, v, g, beta, s) for s in states])
        stepped = bench(lambda: [gd.gated_delta_step_states(q, k, v, g, beta, s) for s in states])
        row = {"gated_delta_rows": B, "T": T, "ms_per_layer": plain / 24 * 1e3,
               "ms_per_layer_step_states": stepped / 24 * 1e3}
        rows.append(row)
        print(json.dumps({"batch_gemm": row}), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", help="comma list of: gated_delta, attention, streaming, matmul, q4_matmul, "
                                       "q4_fused, bf16_stacked, block_attention, kv_rollback, conv, batch_gemm")
    args = parser.parse_args()
    sections = {"gated_delta": gated_delta_rows, "attention": attention_rows, "streaming": streaming_rows,
                "matmul": matmul_rows, "q4_matmul": q4_matmul_rows, "q4_fused": q4_fused_rows,
                "bf16_stacked": bf16_stacked_rows, "block_attention": block_attention_rows,
                "kv_rollback": kv_rollback_rows, "conv": conv_rows,
                "batch_gemm": batch_gemm_rows}
    chosen = args.only.split(",") if args.only else list(sections)
    report = {"device": str(mx.default_device()), "backend": backend(), "mlx": mx.__version__,
              "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(report), flush=True)
    for name in chosen:
        report[name] = sections[name]()
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
