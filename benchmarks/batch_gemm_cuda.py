"""An experiment, not in the engine: bf16 `x @ w.T` for 33..128 rows of x (8 rows of 16-token
verify blocks is 128) by our own tensor-core kernel, to take the products of a batched verify off
MLX's cuBLASLt path, whose host work is about 12 us a call, some 1.6 ms per 8-row verify of the
Qwen3.5-9B shape (docs/performance.md, "Where an 8-row verify's host time goes, sampled").

It works, and it is exact: each token's output is bit-identical to the engine's stream kernel's
(dflash_core/kernels/bf16_matmul_cuda.py) for that token alone or in its 16-row block, so a
request would get the same logits batched as alone. But on the H200 it multiplies 128 rows at
about half of MLX's speed (docs/performance.md, "A batch kernel of our own for 128 rows: not
faster"), which costs more device time than the host time it saves, so the engine keeps MLX's
GEMM past 32 rows.

How it is built. Same arithmetic as the stream kernel: each 16-row weight tile's K is split into
the stream kernel's NW slices (`warps_for`, which depends on N and K only), each slice's 32-k
chunks are multiplied in order with the same two MMAs per chunk, and the slices' partial sums are
added in slice order starting from 0.0f. The work split differs:

- A block is WT warps on the same K slice, each RT 16-row weight tiles and 1/TH of the tokens.
  The slice's x (up to 128 tokens) is staged in shared memory one phase of PC chunks at a time
  (cp.async, double buffered) and read by all the block's warps: the stream kernel reads x once
  per 16 weight rows, which at 128 tokens would be 8 times the weights' bytes.
- Each warp keeps ST - 1 phases of weights in flight in registers while it multiplies the
  current one, as the stream kernel does.
- With NW > 1 the slices are different blocks: they write float32 partials [NW, M, N] and a
  second kernel sums them in slice order.

    python benchmarks/batch_gemm_cuda.py --variants 8x2x1x1x3x1,8x2x2x1x3x2 --out batch_gemm.json

A variant is WT x PC x MIN_BLOCKS x RT x ST x TH. Each row: a Qwen3.5-9B weight (stacked as the
engine stacks it; several copies so that nothing comes from L2) at M = 64 and 128, TB/s of weight
bytes for MLX's `x @ w.T` and for each variant, or "WRONG" where a variant's first 16 rows are not
bit-identical to the stream kernel's.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernels import bench  # noqa: E402

from dflash_core.kernels import bf16_matmul_cuda  # noqa: E402
from dflash_core.kernels.quantized_matmul_cuda import MMA_BF16_16816  # noqa: E402

MIN_ROWS = 33  # fewer rows go to the stream kernel
MAX_ROWS = 128
WARPS = 8  # weight tiles (warps) per block, sharing one staging of x
PHASE_CHUNKS = 2  # 32-k chunks per staging phase: 2 x 2 x 128 tokens x 64 B = 32 KB of shared memory
MIN_BLOCKS = 1  # blocks per SM the registers must allow
TILES = 1  # 16-row weight tiles per warp, each x fragment read once for all of them
STAGES = 3  # phases of weights in registers: the current one and ST - 1 loading
TOKEN_GROUPS = 1  # warps sharing a weight tile, each with its share of the token tiles

_HEADER = MMA_BF16_16816 + """
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void copy_async_16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" :: "r"(d), "l"(src));
}
"""

_SOURCE = """
    constexpr int ROWS = 16;
    constexpr int MP = NT * 8;  // token slots staged
""" + bf16_matmul_cuda.SHAPES_AND_LANES + """
    const int slice = blockIdx.x % NW;
    constexpr int NTW = NT / TH;  // token tiles per warp: TH warps share a weight tile
    const int tg = warp % TH;  // this warp's group of token tiles
    const int tile0 = ((blockIdx.x / NW) * (WT / TH) + warp / TH) * RT;  // this warp's RT weight tiles
    const uint4 zero = make_uint4(0, 0, 0, 0);

    // x of one phase: [buffer][chunk][token][4 x 16 B] in dynamic shared memory; a token's
    // 64-byte rows make the MMA's 16-byte reads (lane (g, t): token g, bytes 16t) free of bank
    // conflicts.
    extern __shared__ __align__(16) uint4 x_shared[];
    auto xs = reinterpret_cast<uint4 (*)[PC][MP][4]>(x_shared);

    const int chunks = K / 32;
    const int c_begin = (slice * chunks) / NW;
    const int c_end = ((slice + 1) * chunks) / NW;
    const int phases = (c_end - c_begin + PC - 1) / PC;

    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    bool tile_real[RT];
    const uint4* w_lo[RT];
    const uint4* w_hi[RT];
    #pragma unroll
    for (int i = 0; i < RT; ++i) {
      tile_real[i] = (tile0 + i) * ROWS < N;
      const int row0 = (tile_real[i] ? tile0 + i : 0) * ROWS;
      w_lo[i] = reinterpret_cast<const uint4*>(w + (size_t)(row0 + g) * K) + t;
      w_hi[i] = reinterpret_cast<const uint4*>(w + (size_t)(row0 + g + 8) * K) + t;
    }

    auto stage = [&](int buf, int c) {
      for (int q = threadIdx.x; q < PC * MP * 4; q += WT * 32) {
        const int part = q & 3;
        const int token = (q >> 2) % MP;
        const int u = (q >> 2) / MP;
        uint4* dst = &xs[buf][u][token][part];
        if (token < M && c + u < c_end) copy_async_16(dst, x4 + (size_t)token * (K / 8) + (c + u) * 4 + part);
        else *dst = zero;
      }
      asm volatile("cp.async.commit_group;\\n" ::);
    };

    float acc[RT][NTW][4];
    #pragma unroll
    for (int i = 0; i < RT; ++i)
      #pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][nt][e] = 0.0f;

    auto load = [&](uint4 (&wr)[RT][PC][2], int c) {
      #pragma unroll
      for (int i = 0; i < RT; ++i)
        #pragma unroll
        for (int u = 0; u < PC; ++u) {
          const bool in = tile_real[i] && c + u < c_end;
          wr[i][u][0] = in ? load_stream(w_lo[i] + (c + u) * 4) : zero;
          wr[i][u][1] = in ? load_stream(w_hi[i] + (c + u) * 4) : zero;
        }
    };
    // A chunk's two MMAs per (weight tile, token tile), the first of every pair in a group before
    // the seconds: a pair's second MMA waits for its first, so RT * NB - 1 others go between (each
    // sum keeps the stream kernel's order). An x fragment read from shared memory feeds all RT
    // tiles. Chunks past the slice multiply zero weights by zero x, adding exact zeros as the
    // stream kernel's do.
    constexpr int NB = NTW < 8 / RT ? NTW : 8 / RT;
    auto compute = [&](const uint4 (&wr)[RT][PC][2], int buf) {
      #pragma unroll
      for (int u = 0; u < PC; ++u) {
        #pragma unroll
        for (int h = 0; h < NTW; h += NB) {
          uint4 xv[NB];
          #pragma unroll
          for (int j = 0; j < NB; ++j) xv[j] = xs[buf][u][(tg * NTW + h + j) * 8 + g][t];
          #pragma unroll
          for (int i = 0; i < RT; ++i)
            #pragma unroll
            for (int j = 0; j < NB; ++j)
              mma_bf16_16816(acc[i][h + j], wr[i][u][0].x, wr[i][u][1].x, wr[i][u][0].y, wr[i][u][1].y,
                             xv[j].x, xv[j].y);
          #pragma unroll
          for (int i = 0; i < RT; ++i)
            #pragma unroll
            for (int j = 0; j < NB; ++j)
              mma_bf16_16816(acc[i][h + j], wr[i][u][0].z, wr[i][u][1].z, wr[i][u][0].w, wr[i][u][1].w,
                             xv[j].z, xv[j].w);
        }
      }
    };
    // Phase p: stage x of p + 1, issue the weights of p + ST - 1 into the registers p - 1 used,
    // then multiply p once its x has landed. Every thread reaches both barriers (phases is the
    // same for the whole block).
    auto phase = [&](const uint4 (&cur)[RT][PC][2], uint4 (&ahead)[RT][PC][2], int p) {
      const int c = c_begin + p * PC;
      const bool more = p + 1 < phases;
      if (more) stage((p + 1) & 1, c + PC);
      if (p + ST - 1 < phases) load(ahead, c + (ST - 1) * PC);
      if (more) asm volatile("cp.async.wait_group 1;\\n" ::);
      else asm volatile("cp.async.wait_group 0;\\n" ::);
      __syncthreads();
      compute(cur, p & 1);
      __syncthreads();
    };

    uint4 wa[RT][PC][2], wb[RT][PC][2], wc[RT][PC][2];
    stage(0, c_begin);
    load(wa, c_begin);
    if (ST == 3) {
      if (phases > 1) load(wb, c_begin + PC);
      for (int p = 0; p < phases; p += 3) {
        phase(wa, wc, p);
        if (p + 1 < phases) phase(wb, wa, p + 1);
        if (p + 2 < phases) phase(wc, wb, p + 2);
      }
    } else {
      for (int p = 0; p < phases; p += 2) {
        phase(wa, wb, p);
        if (p + 1 < phases) phase(wb, wa, p + 1);
      }
    }

    // Accumulator lane layout: (row g, tokens 2t, 2t+1) and (row g + 8, the same tokens). One
    // slice writes the result (0.0f + its sum, as the stream kernel's reduction), several write
    // partials [NW, M, N] for `sum_slices`.
    #pragma unroll
    for (int i = 0; i < RT; ++i) {
      if (!tile_real[i]) continue;
      const int row0 = (tile0 + i) * ROWS;
      #pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int token = (tg * NTW + nt) * 8 + 2 * t + (e & 1);
          const int r = g + (e >> 1) * 8;
          if (token < M) {
            const float v = NW == 1 ? 0.0f + acc[i][nt][e] : acc[i][nt][e];
            out[((size_t)slice * M + token) * N + row0 + r] = static_cast<OutT>(v);
          }
        }
      }
    }
"""

_SUM_SLICES = """
    const size_t size = (size_t)partial_shape[1] * partial_shape[2];
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= size) return;
    float sum = 0.0f;
    #pragma unroll
    for (int p = 0; p < NW; ++p) sum += partial[p * size + i];
    y[i] = static_cast<OutT>(sum);
"""


def _launch_bounds(threads: int, min_blocks: int) -> str:
    """Launch bounds for the kernel MLX declares after the header. MLX's generated signature has no
    place for them, and without them the compiler may take more registers than a block of
    `threads` can have (the launch then fails for 16 token tiles): the header's last lines make
    `__global__`, which MLX writes before the kernel's name, carry them."""
    return f"""
#undef __global__
#define __global__ __location__(global) __launch_bounds__({threads}, {min_blocks})
"""


@functools.cache
def _gemm(shared_bytes: int, threads: int, min_blocks: int):
    """The kernel with `shared_bytes` of dynamic shared memory and launch bounds (both fixed per
    kernel object in MLX)."""
    return mx.fast.cuda_kernel(name=f"dflash_batch_gemm_{threads}_{min_blocks}", input_names=["x", "w"],
                               output_names=["out"], source=_SOURCE,
                               header=_HEADER + _launch_bounds(threads, min_blocks), shared_memory=shared_bytes)


@functools.cache
def _sum_slices():
    return mx.fast.cuda_kernel(name="dflash_batch_gemm_sum", input_names=["partial"], output_names=["y"],
                               source=_SUM_SLICES)


def supported(rows: int, x: mx.array, w: mx.array) -> bool:
    """bf16 x [33..128 rows, K] and w [N, K], K a multiple of 32, N of 16."""
    return MIN_ROWS <= rows <= MAX_ROWS and bf16_matmul_cuda.supported(1, x, w)


def token_tiles(rows: int) -> int:
    """8-token tiles staged for `rows`, rounded up to 8, 12 or 16 so that batches of any size
    compile three kernels, not twelve; the extra slots hold zeros and are never written."""
    return next(n for n in (8, 12, 16) if n * 8 >= rows)


def matmul_batch(x: mx.array, w: mx.array, warps: int = WARPS, phase_chunks: int = PHASE_CHUNKS,
                 min_blocks: int = MIN_BLOCKS, tiles: int = TILES, stages: int = STAGES,
                 token_groups: int = TOKEN_GROUPS) -> mx.array:
    """x [M, K] @ w[N, K].T -> [M, N] in bf16 for 33 <= M <= 128, bit-identical per token to
    `bf16_matmul_cuda.matmul_stream` (whose K split it takes)."""
    M, K = x.shape
    N = w.shape[0]
    nw = min(bf16_matmul_cuda.warps_for(N, K, 4), bf16_matmul_cuda.max_warps(4))
    nt = token_tiles(M)
    blocks = -(-(N // 16) // (warps // token_groups * tiles)) * nw
    out_dtype = x.dtype if nw == 1 else mx.float32
    out = _gemm(2 * phase_chunks * nt * 8 * 64, warps * 32, min_blocks)(
        inputs=[x, w], template=[("OutT", out_dtype), ("NW", nw), ("NT", nt), ("WT", warps), ("PC", phase_chunks),
                                     ("RT", tiles), ("ST", stages), ("TH", token_groups)],
        grid=(blocks * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(M, N) if nw == 1 else (nw, M, N)], output_dtypes=[out_dtype])[0]
    if nw == 1:
        return out
    return _sum_slices()(inputs=[out], template=[("OutT", x.dtype), ("NW", nw)],
                         grid=(-(-(M * N) // 256) * 256, 1, 1), threadgroup=(256, 1, 1),
                         output_shapes=[(M, N)], output_dtypes=[x.dtype])[0]


SHAPES = {"gdn in_proj (stacked)": (12352, 4096, 16), "attention qkv (stacked)": (10240, 4096, 16),
          "mlp gate+up (stacked)": (24576, 4096, 8), "mlp down": (4096, 12288, 16), "out_proj": (4096, 4096, 16),
          "lm head": (248320, 4096, 1)}  # N, K, copies


def sweep_rows(variants: list[tuple[int, ...]], shapes: list[str], row_counts: list[int]) -> list[dict]:
    rows = []
    for label in shapes:
        N, K, copies = SHAPES[label]
        weights = [(mx.random.normal((N, K)) / K**0.5).astype(mx.bfloat16) for _ in range(copies)]
        mx.eval(weights)
        nbytes = sum(w.nbytes for w in weights)
        for M in row_counts:
            x = mx.random.normal((M, K)).astype(mx.bfloat16)
            stream = bf16_matmul_cuda.matmul_stream(x[:16], weights[0])
            mlx = bench(lambda: [x @ w.T for w in weights])
            row = {"weights": label, "N": N, "K": K, "M": M, "mlx_tb_s": round(nbytes / mlx / 1e12, 2)}
            for variant in variants:
                exact = mx.array_equal(matmul_batch(x, weights[0], *variant)[:16], stream).item()
                t = bench(lambda: [matmul_batch(x, w, *variant) for w in weights])
                row["x".join(map(str, variant))] = round(nbytes / t / 1e12, 2) if exact else "WRONG"
            rows.append(row)
            print(json.dumps(row), flush=True)
        weights = None
        mx.clear_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="8x2x1x1x3x1", help="comma list of WTxPCxMIN_BLOCKSxRTxSTxTH")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--rows", default="64,128", help="comma list of row counts (33..128)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = [tuple(int(v) for v in item.split("x")) for item in args.variants.split(",")]
    report = {"device": str(mx.default_device()), "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": "python benchmarks/batch_gemm_cuda.py " + " ".join(sys.argv[1:]),
              "rows": sweep_rows(variants, args.shapes.split(","), [int(m) for m in args.rows.split(",")])}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
