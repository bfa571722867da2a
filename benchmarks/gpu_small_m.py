"""Small-M bf16 products `x @ W.T` at the Qwen3.5-9B shapes on CUDA: how fast MLX streams the
weights, how fast the streaming kernel of small_m_stream_cuda.py does, and what bounds both.

    python benchmarks/gpu_small_m.py --out small_m.json             # timings in this process
    python benchmarks/gpu_small_m.py --ncu > trace.csv ...          # under ncu: see --ncu

Sections, one process:
- ceilings: a copy (`src + 0`, read + write) and a read-only stream kernel, over weights made on
  the device (MLX's cudaMallocAsync pool) and over weights made from host memory (MLX's managed
  memory, as mx.load's arrays are), plus MLX's GEMM over both;
- exactness of the kernel: against a float32 product (MLX's own error beside it), and each
  token's row bit-identical whether multiplied alone or with up to 31 others;
- streaming, TB/s of weight bytes: MLX's GEMM, the kernel per loads-in-flight group U and warps
  per block, and small_m_matmul_cuda.py's pipelined kernel, at M = 1..32, each shape rotating over
  about 1 GB of distinct weights so that nothing comes from L2.

With --ncu the script launches each configuration three times after a marker kernel whose grid
is the configuration's index, and prints the configurations as JSON lines; run it under
`ncu --csv --page raw ...` and match the trace's rows to configurations by the markers
(parse_ncu.py in the same folder, `--trace` and `--configs`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import small_m_matmul_cuda as old_kernel  # noqa: E402
import small_m_stream_cuda as stream  # noqa: E402
from small_m_shapes import ROTATION_BYTES, ROWS, SHAPES, emitter  # noqa: E402

from dflash_core.kernels import quantized_matmul_cuda as q4  # noqa: E402


def median_seconds(fn, warmup=2, reps=7, chained=4) -> float:
    """Median seconds of one evaluation of fn's arrays, each sample `chained` evaluations queued
    back to back (as the engine queues its forwards) so that a sync's fixed cost is spread."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(chained - 1):
            mx.async_eval(fn())
        mx.eval(fn())
        times.append((time.perf_counter() - start) / chained)
    return statistics.median(times)


def weights_for(N, K, from_host=False):
    count = max(2, int(ROTATION_BYTES // (2 * N * K)))
    if from_host:
        rng = np.random.default_rng(0)
        ws = [mx.array(rng.standard_normal((N, K), dtype=np.float32)).astype(mx.bfloat16) for _ in range(count)]
    else:
        ws = [(mx.random.normal((N, K)) * K**-0.5).astype(mx.bfloat16) for _ in range(count)]
    mx.eval(ws)
    return ws


def quantized(ws):
    """The weights as MLX's 4-bit affine (group 64) triples."""
    qs = [mx.quantize(w, group_size=64, bits=4) for w in ws]
    mx.eval(qs)
    return qs


# (warps splitting K, chunks loaded ahead); 16 warps with U = 2, or U = 4, need more registers than
# a block has at 16 rows (the launch fails).
Q4_SWEEP = [(nw, u) for nw in (4, 8) for u in (1, 2)]


def q4_paths_for(M, sweep=False):
    """(name, fn(x, (w, scales, biases))) for the 4-bit paths at M rows; `sweep`: our kernel also at
    every (NW, U) of Q4_SWEEP (MT as launch_shape picks it), named ours_q4_nw{NW}_u{U}."""
    paths = [("mlx_qmm", lambda x, q: mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=4))]
    if M <= 16:
        paths.append(("ours_q4", lambda x, q: q4.quantized_matmuls_cuda(x, [q], 64)[0]))
        for nw, u in Q4_SWEEP if sweep else ():
            def fn(x, q, nw=nw, u=u):
                _, mt, _ = q4.launch_shape((q[0].shape[0],), x.shape[1], x.shape[0])
                return q4.quantized_matmuls_cuda(x, [q], 64, shape=(nw, mt, u))[0]
            paths.append((f"ours_q4_nw{nw}_u{u}", fn))
    return paths


def paths_for(M, quant="bf16", sweep=False):
    """(name, fn(x, w)) for every path measured at M rows."""
    if quant == "4bit":
        return q4_paths_for(M, sweep)
    paths = [("mlx", lambda x, w: x @ w.T)]
    if M > 32:
        return paths
    us = (2, 4, 8) if M <= 8 else (2, 4) if M <= 16 else (1, 2)
    for U in us:
        paths.append((f"stream_u{U}", lambda x, w, U=U: stream.matmul_stream(x, w, U=U)))
    U = us[-1]
    for scale in (0.5, 2):
        def fn(x, w, U=U, scale=scale):
            nw = max(1, int(stream.warps_for(w.shape[0], w.shape[1], U) * scale))
            return stream.matmul_stream(x, w, U=U, warps=nw)
        paths.append((f"stream_u{U}_warps_x{scale}", fn))
    if M <= 16:
        paths.append(("old_pipelined", lambda x, w: old_kernel.matmul_cuda(x, w)))
    return paths


def ceilings(emit):
    N, K = SHAPES["gate_up 24576x4096"]
    for from_host in (False, True):
        ws = weights_for(N, K, from_host)
        nbytes = sum(w.nbytes for w in ws)
        flat = [w.reshape(-1) for w in ws]
        where = "host-made (managed)" if from_host else "device-made"
        emit({"section": "ceiling", "op": "copy src+0 (read+write)", "memory": where,
              "tb_s": 2 * nbytes / median_seconds(lambda: [f + 0 for f in flat]) / 1e12})
        for U in (4, 8, 16):
            emit({"section": "ceiling", "op": f"read stream kernel U={U}", "memory": where,
                  "tb_s": nbytes / median_seconds(lambda U=U: [stream.read_probe(f, U=U) for f in flat]) / 1e12})
        for M in (1, 16):
            x = mx.random.normal((M, K)).astype(mx.bfloat16)
            emit({"section": "ceiling", "op": f"mlx gemm M={M}", "memory": where,
                  "tb_s": nbytes / median_seconds(lambda: [x @ w.T for w in ws]) / 1e12})
        mx.clear_cache()


def exactness(emit):
    for N, K in ((4096, 4096), (12352, 4096), (4096, 12288), (1024, 5376), (32, 4096)):
        w = (mx.random.normal((N, K)) * K**-0.5).astype(mx.bfloat16)
        x32 = mx.random.normal((32, K)).astype(mx.bfloat16)
        alone = stream.matmul_stream(x32[:1], w)
        worst, worst_mlx, invariant = 0.0, 0.0, True
        for M in range(1, 33):
            x = x32[:M]
            ref = x.astype(mx.float32) @ w.astype(mx.float32).T
            ours = stream.matmul_stream(x, w).astype(mx.float32)
            scale = mx.abs(ref).max().item()
            worst = max(worst, mx.abs(ours - ref).max().item() / scale)
            worst_mlx = max(worst_mlx, mx.abs((x @ w.T).astype(mx.float32) - ref).max().item() / scale)
            invariant = invariant and bool(mx.array_equal(ours[:1], alone.astype(mx.float32)).item())
        emit({"section": "exact", "N": N, "K": K, "max_rel_err_vs_fp32": worst, "mlx_max_rel_err_vs_fp32": worst_mlx,
              "row_invariant": invariant})


def streaming(emit, shapes, rows):
    for name in shapes:
        N, K = SHAPES[name]
        ws = weights_for(N, K)
        nbytes = sum(w.nbytes for w in ws)
        for M in rows:
            x = mx.random.normal((M, K)).astype(mx.bfloat16)
            row = {"section": "stream", "shape": name, "M": M}
            for path, fn in paths_for(M):
                if path.startswith("old") and not old_kernel.supported(M, x.dtype, w=ws[0]):
                    continue
                if path.startswith("stream") and not stream.supported(M, x, ws[0]):
                    continue
                row[path] = round(nbytes / median_seconds(lambda: [fn(x, w) for w in ws]) / 1e12, 3)
            emit(row)
        mx.clear_cache()


def ncu_configs(emit, shapes, rows, quant="bf16", sweep=False):
    """Each configuration: a marker, then up to three launches over distinct weights (cold L2)."""
    index = 0 if quant == "bf16" else 10000  # bf16 and 4-bit configurations never share an index
    for name in shapes:
        mx.eval(stream.marker(stream.IGNORE))  # this shape's weight set-up belongs to no configuration
        N, K = SHAPES[name]
        ws = weights_for(N, K)[:3]
        if quant == "4bit":
            ws = quantized(ws)
        nbytes = sum(a.nbytes for a in ws[0]) if quant == "4bit" else ws[0].nbytes
        for M in rows:
            x = mx.random.normal((M, K)).astype(mx.bfloat16)
            for path, fn in paths_for(M, quant, sweep):
                if path.startswith("old") and not old_kernel.supported(M, x.dtype, w=ws[0]):
                    continue
                mx.eval(stream.marker(stream.IGNORE))
                mx.eval([fn(x, w) for w in ws])  # compile and warm outside the measured range
                mx.eval(stream.marker(index))
                for w in ws:
                    mx.eval(fn(x, w))
                emit({"index": index, "shape": name, "N": N, "K": K, "M": M, "path": path, "quant": quant,
                      "weight_bytes": nbytes, "launches": len(ws)})
                index += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write every row here as JSON lines")
    parser.add_argument("--only", default="ceilings,exact,stream", help="comma list of: ceilings, exact, stream")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma list of SHAPES keys")
    parser.add_argument("--rows", default=",".join(map(str, (*ROWS, 128))))
    parser.add_argument("--ncu", action="store_true", help="marked launches for an ncu trace (configs on stdout)")
    parser.add_argument("--quant", default="bf16", help="bf16, 4bit or both (--ncu only)")
    parser.add_argument("--q4-sweep", action="store_true", help="with --ncu: our 4-bit kernel at every (NW, U) too")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    emit = emitter(args.out)

    if args.ncu:
        for quant in (("bf16", "4bit") if args.quant == "both" else (args.quant,)):
            ncu_configs(emit, shapes, rows, quant, args.q4_sweep)
        return 0
    only = set(args.only.split(","))
    if "ceilings" in only:
        ceilings(emit)
    if "exact" in only:
        exactness(emit)
    if "stream" in only:
        streaming(emit, shapes, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
