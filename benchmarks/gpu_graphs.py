"""Which products keep MLX's CUDA graphs cheap: one process per graph setting, a chain of layers
(product, residual add, RMS norm) through one kind of product at a time.

    MLX_USE_CUDA_GRAPHS=1 python benchmarks/gpu_graphs.py --out on.json
    MLX_USE_CUDA_GRAPHS=0 python benchmarks/gpu_graphs.py --out off.json

Kinds: `gemm16` MLX's matmul for 16 rows (cuBLASLt on CUDA), `gemv1` MLX's matmul for one row
(MLX's own GEMV kernel), `stream16` the engine's bf16 stream kernel (bf16_matmul_cuda.py) for 16 rows
(an `mx.fast.cuda_kernel` launch), `q4_16` this project's 4-bit kernel for 16 rows.

Why: MLX records kernels into a CUDA graph and, every 100 operations on this card, either updates
the executable graph it cached for the same sequence of node kinds (cheap) or instantiates a new
one; it must instantiate when a captured library call put a node into the graph that it cannot
update. A DFlash cycle with graphs on costs about 9 ms more than with them off
(docs/performance.md, "MLX's CUDA graphs and the cycle"). Per kind this prints:

- `host_ms`: host time to build a chain and hand it to the device (`mx.async_eval`), where
  graph instantiation or update happens, with a fresh input each time (so a cached graph must be
  updated, as in a cycle);
- `wall_ms`: one chain built, run and read back (synchronised), as a cycle's verify is;
- `pipelined_ms`: chains queued back to back, as plain decode steps are.

Graphs on against off for the same kind says what the graphs cost or save for that product.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.kernels import bf16_matmul_cuda as stream  # noqa: E402
from dflash_core.kernels import quantized_matmul_cuda as q4  # noqa: E402

KINDS = ("gemm16", "gemv1", "stream16", "q4_16")


def build_weights(layers: int, n: int, k: int, quantized: bool):
    mx.random.seed(0)
    weights = []
    for _ in range(layers):
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        weights.append(mx.quantize(w, group_size=64, bits=4) if quantized else w)
        mx.eval(weights[-1])
    return weights


def product(kind: str, x: mx.array, w) -> mx.array:
    if kind in ("gemm16", "gemv1"):
        return x @ w.T
    if kind == "stream16":
        return stream.matmul_stream(x, w)
    wq, scales, biases = w
    return q4.quantized_matmul_cuda(x, wq, scales, biases, 64)


def chain(kind: str, x: mx.array, weights, norm: mx.array) -> mx.array:
    h = x
    for w in weights:
        y = product(kind, h, w)
        h = mx.fast.rms_norm(h + y, norm, 1e-6)
    return h


def measure(kind: str, weights, k: int, reps: int) -> dict:
    rows = 1 if kind == "gemv1" else 16
    norm = mx.ones((k,), dtype=mx.bfloat16)
    inputs = [mx.random.normal((rows, k)).astype(mx.bfloat16) for _ in range(reps + 3)]
    mx.eval(inputs)
    host, wall = [], []
    for i, x in enumerate(inputs):
        start = time.perf_counter()
        h = chain(kind, x, weights, norm)
        mx.async_eval(h)
        built = time.perf_counter()
        mx.eval(h)
        end = time.perf_counter()
        if i >= 3:
            host.append(built - start)
            wall.append(end - start)
    start = time.perf_counter()
    h = inputs[0]
    for _ in range(reps):
        h = chain(kind, h, weights, norm)
        mx.async_eval(h)
    mx.eval(h)
    pipelined = (time.perf_counter() - start) / reps
    return {"host_ms": statistics.median(host) * 1e3, "wall_ms": statistics.median(wall) * 1e3,
            "pipelined_ms": pipelined * 1e3, "ops_per_chain": 3 * len(weights)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"MLX_USE_CUDA_GRAPHS": os.environ.get("MLX_USE_CUDA_GRAPHS", "(default: on)"),
              "MLX_MAX_OPS_PER_BUFFER": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "(default)"),
              "layers": args.layers, "n": args.n, "k": args.k, "kinds": {}}
    bf16 = quantized = None
    for kind in args.kinds.split(","):
        if kind == "q4_16":
            quantized = quantized or build_weights(args.layers, args.n, args.k, True)
            weights = quantized
        else:
            bf16 = bf16 or build_weights(args.layers, args.n, args.k, False)
            weights = bf16
        result["kinds"][kind] = measure(kind, weights, args.k, args.reps)
        print(kind, json.dumps(result["kinds"][kind]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
