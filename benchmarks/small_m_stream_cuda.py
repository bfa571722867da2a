"""An experiment: `x @ w.T` for a few rows of x (M <= 32) on tensor cores, built to keep enough
weight bytes in flight to stream them at the card's bandwidth. Measured by gpu_small_m.py.

Why another one. small_m_matmul_cuda.py's kernels stayed at 1.3-2.5 TB/s. Little's law says why
they may: at ~4 TB/s and ~1 us of loaded DRAM latency the card needs ~4 MB of loads in flight,
~30 KB per SM. Their grid is one 2-warp block per 16 weight rows, so a 4096-row weight has 512
warps for 132 SMs (4 per SM) with 4 KB each in flight, and each warp waits for its loads before
it issues the next ones. Here:

- Every warp keeps two groups of U 32-k chunks in registers and issues the next group's loads
  before the MMAs of the current one (register double buffering), so its loads never drain.
- The block's NW warps split K for one 16-row tile; NW is picked per shape so that the grid has
  about `TARGET_WARPS` warps whatever N is (16 warps of K slices for a 4096-row weight, one for
  the LM head's 248k rows).
- The block sums its warps' partials in a fixed order (the same shared-memory reduction as the
  4-bit kernel), and nothing but the number of 8-token tiles depends on M: a token's output is
  bit-identical whether it is multiplied alone or with the others.

The MMA layout is small_m_matmul_cuda.py's: the weight is the A operand (16 rows x 16 k), x the
B operand (16 k x 8 tokens), k permuted identically in both so that 16-byte loads feed the
fragments directly.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from dflash_core.kernels.quantized_matmul_cuda import MMA_BF16_16816, SUM_WARP_PARTIALS

TARGET_WARPS = 132 * 24  # H200: 132 SMs; ~24 warps each

_HEADER = MMA_BF16_16816 + """
template <int NT>
__device__ __forceinline__ void mma_chunk(float (&acc)[1][NT][4], const uint4& w_lo, const uint4& w_hi,
                                          const uint4 (&x)[NT]) {
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    mma_bf16_16816(acc[0][nt], w_lo.x, w_hi.x, w_lo.y, w_hi.y, x[nt].x, x[nt].y);
    mma_bf16_16816(acc[0][nt], w_lo.z, w_hi.z, w_lo.w, w_hi.w, x[nt].z, x[nt].w);
  }
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
"""

_SOURCE = """
    constexpr int MT = 1;
    constexpr int ROWS = 16;
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int row0 = blockIdx.x * ROWS;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    const uint4* x_rows[NT];
    bool x_real[NT];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int token = nt * 8 + g;
      x_real[nt] = token < M;
      x_rows[nt] = reinterpret_cast<const uint4*>(x + (size_t)(x_real[nt] ? token : 0) * K) + t;
    }
    const uint4* w_lo = reinterpret_cast<const uint4*>(w + (size_t)(row0 + g) * K) + t;
    const uint4* w_hi = reinterpret_cast<const uint4*>(w + (size_t)(row0 + g + 8) * K) + t;

    // This warp's 32-k chunks: a split fixed by K and NW alone.
    const int chunks = K / 32;
    const int c_begin = (warp * chunks) / NW;
    const int c_end = ((warp + 1) * chunks) / NW;

    float acc[1][NT][4];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][nt][i] = 0.0f;

    uint4 wa[U][2], wb[U][2];
    uint4 xa[U][NT], xb[U][NT];
    // Chunks past c_end load zeros, whose products add exact zeros.
    auto load = [&](uint4 (&wr)[U][2], uint4 (&xr)[U][NT], int c) {
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        const bool in = c + u < c_end;
        wr[u][0] = in ? load_stream(w_lo + (c + u) * 4) : zero;
        wr[u][1] = in ? load_stream(w_hi + (c + u) * 4) : zero;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) xr[u][nt] = (in && x_real[nt]) ? __ldg(x_rows[nt] + (c + u) * 4) : zero;
      }
    };
    auto compute = [&](const uint4 (&wr)[U][2], const uint4 (&xr)[U][NT]) {
      #pragma unroll
      for (int u = 0; u < U; ++u) mma_chunk<NT>(acc, wr[u][0], wr[u][1], xr[u]);
    };

    load(wa, xa, c_begin);
    for (int c = c_begin; c < c_end; c += 2 * U) {
      load(wb, xb, c + U);
      compute(wa, xa);
      if (c + 2 * U < c_end) load(wa, xa, c + 2 * U);
      if (c + U < c_end) compute(wb, xb);
    }
    __shared__ float partial[NW][ROWS][NT * 8];
""" + SUM_WARP_PARTIALS


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="dflash_small_m_stream",
        input_names=["x", "w"],
        output_names=["y"],
        source=_SOURCE,
        header=_HEADER,
    )


def supported(rows: int, x: mx.array, w: mx.array) -> bool:
    """bf16 x [rows <= 32, K] and w [N, K], K a multiple of 32, N of 16."""
    return (1 <= rows <= 32 and x.dtype == mx.bfloat16 and w.dtype == mx.bfloat16 and w.ndim == 2
            and w.shape[1] % 32 == 0 and w.shape[0] % 16 == 0)


def max_warps(U: int) -> int:
    """Warps per block whose registers fit in an SM's 64K for up to 4 token tiles: U double-buffered
    chunks of weights and x take 8 * U * (2 + NT) registers a thread. It must not depend on M:
    the K split decides the order of the sums, so a token's output would change with the rows
    beside it (seen on the H200 when it did)."""
    return 16 if U == 1 else 8


def warps_for(N: int, K: int, U: int, target: int = TARGET_WARPS) -> int:
    """Warps per block (K slices of a 16-row tile): enough for `target` warps in the grid, within
    `max_warps`, and each warp at least one group of U chunks."""
    tiles = N // 16
    nw = 1
    while nw < max_warps(U) and tiles * nw < target and (K // 32) // (2 * nw) >= U:
        nw *= 2
    return nw


def matmul_stream(x: mx.array, w: mx.array, U: int = 4, warps: int = 0) -> mx.array:
    """x [M, K] @ w[N, K].T -> [M, N] in bf16; `warps` 0 picks them by `warps_for`."""
    M, K = x.shape
    N = w.shape[0]
    NT = (M + 7) // 8
    nw = min(warps or warps_for(N, K, U), max_warps(U))
    return _kernel()(
        inputs=[x, w],
        template=[("OutT", x.dtype), ("NW", nw), ("NT", NT), ("U", U)],
        grid=(N // 16 * nw * 32, 1, 1),
        threadgroup=(nw * 32, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )[0]


_READ_SOURCE = """
    // Reads every 16 bytes of `src` once (U loads in flight per thread), so nothing but the
    // stream bounds it; writes one word per thread so the loads are not optimised away.
    const size_t words = src_shape[0] / 8;  // uint4 words of 8 bf16
    const uint4* p = reinterpret_cast<const uint4*>(src);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned h = 0;
    for (; i + (U - 1) * stride < words; i += U * stride) {
      uint4 v[U];
      #pragma unroll
      for (int u = 0; u < U; ++u) v[u] = load_stream(p + i + u * stride);
      #pragma unroll
      for (int u = 0; u < U; ++u) h ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < words; i += stride) { uint4 v = load_stream(p + i); h ^= v.x ^ v.y ^ v.z ^ v.w; }
    out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = h;
"""


@functools.cache
def _read_kernel():
    return mx.fast.cuda_kernel(name="dflash_read_probe", input_names=["src"], output_names=["out"],
                               source=_READ_SOURCE, header=_HEADER)


def read_probe(src: mx.array, blocks: int = 132 * 8, threads: int = 256, U: int = 8) -> mx.array:
    """Streams a flat bf16 array once; returns a word per thread."""
    return _read_kernel()(inputs=[src], template=[("U", U)], grid=(blocks * threads, 1, 1),
                          threadgroup=(threads, 1, 1), output_shapes=[(blocks * threads,)],
                          output_dtypes=[mx.uint32])[0]


IGNORE = 65535  # a marker index that ends the range before it without starting one
_MARKER_SOURCE = "if (threadIdx.x == 0) out[blockIdx.x] = blockIdx.x;"


@functools.cache
def _marker_kernel():
    return mx.fast.cuda_kernel(name="dflash_marker", input_names=["dummy"], output_names=["out"],
                               source=_MARKER_SOURCE)


def marker(index: int) -> mx.array:
    """A tiny launch whose grid (index + 1 blocks) tells an ncu trace where a measurement starts."""
    return _marker_kernel()(inputs=[mx.zeros((1,))], grid=((index + 1) * 32, 1, 1), threadgroup=(32, 1, 1),
                            output_shapes=[(index + 1,)], output_dtypes=[mx.int32])[0]
