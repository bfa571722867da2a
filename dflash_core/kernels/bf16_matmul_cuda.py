"""bf16 `x @ w.T` for a few rows of x (M <= 32) on tensor cores, streaming the weights, for decode,
verify and draft forwards on CUDA (`KernelOptions.bf16_stream`, matmul.py). Kernel-only it matches
MLX's products at M <= 16 but does not beat them; what it saves is host time: an
`mx.fast.cuda_kernel` launch costs less per call than MLX's cuBLASLt path, and is a plain kernel
node in MLX's CUDA graphs where a captured cuBLASLt call is not (docs/performance.md, "MLX's CUDA
graphs and the cycle").

How it keeps the weights streaming. At ~4 TB/s and ~1 us of loaded DRAM latency the card needs
~4 MB of loads in flight, ~30 KB per SM. Here:

- Every warp keeps two groups of U 32-k chunks in registers and issues the next group's loads
  before the MMAs of the current one (register double buffering), so its loads never drain.
- The block's NW warps split K for one 16-row tile; NW is picked per shape so that the grid has
  about `TARGET_WARPS` warps whatever N is (16 warps of K slices for a 4096-row weight, one for
  the LM head's 248k rows).
- The block sums its warps' partials in a fixed order (the same shared-memory reduction as the
  4-bit kernel), and nothing but the number of 8-token tiles depends on M: a token's output is
  bit-identical whether it is multiplied alone or with the others, which the lossless loop needs
  (a decode step's one row and a verify's sixteen give the same logits).

The MMA layout is the weight as the A operand (16 rows x 16 k), x the B operand (16 k x 8 tokens),
k permuted identically in both so that 16-byte loads feed the fragments directly.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .quantized_matmul_cuda import MMA_BF16_16816, SUM_WARP_PARTIALS

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

# x [M, K] and w [N, K]; a lane's place in the MMA fragments: group g (row or token), thread t (k).
SHAPES_AND_LANES = """
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
"""

_SOURCE = """
    constexpr int MT = 1;
    constexpr int ROWS = 16;
""" + SHAPES_AND_LANES + """
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
"""

_SUMS = """
    __shared__ float partial[NW][ROWS][NT * 8];
""" + SUM_WARP_PARTIALS


def _output_selection(parts: int) -> str:
    """For a weight stacked from `parts` weights (rows S1, S2, ... where each next one starts, all
    multiples of 16, so a block's 16 rows never straddle two): a scope in which `y`, `N` and `row0`
    name the output, width and first row of the part this block's rows belong to, so that each
    part's product lands in an array of its own, contiguous, instead of columns of one output that
    a reshape would have to copy."""
    lines = ["    const int tile_row = row0;", "    {",
             "    auto y = y0;", "    int N = S1;", "    int row0 = tile_row;"]
    for i in range(1, parts):
        end = f"S{i + 1}" if i + 1 < parts else "w_shape[0]"
        lines.append(f"    if (tile_row >= S{i}) {{ y = y{i}; N = {end} - S{i}; row0 = tile_row - S{i}; }}")
    return "\n".join(lines) + "\n"


@functools.cache
def _kernel(parts: int = 1):
    if parts == 1:
        return mx.fast.cuda_kernel(name="dflash_small_m_stream", input_names=["x", "w"], output_names=["y"],
                                   source=_SOURCE + _SUMS, header=_HEADER)
    return mx.fast.cuda_kernel(
        name=f"dflash_small_m_stream_parts{parts}",
        input_names=["x", "w"],
        output_names=[f"y{i}" for i in range(parts)],
        source=_SOURCE + _output_selection(parts) + _SUMS + "    }\n",
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
    return matmul_stream_parts(x, w, (), U, warps)[0]


def parts_supported(w: mx.array, splits) -> bool:
    """Whether `matmul_stream_parts` takes these split points of w's rows: increasing multiples of
    16 inside the weight."""
    bounds = [0, *splits, w.shape[0]]
    return all(b % 16 == 0 and a < b for a, b in zip(bounds, bounds[1:]))


def matmul_stream_parts(x: mx.array, w: mx.array, splits=(), U: int = 4, warps: int = 0) -> list[mx.array]:
    """`mx.split(matmul_stream(x, w), splits, axis=-1)` as contiguous arrays [M, N_i], from one launch
    and the same bits: the same grid and sums, each 16-row tile written to its part's own output.
    The warps are picked for the whole stacked weight, as for one product of it."""
    M, K = x.shape
    N = w.shape[0]
    NT = (M + 7) // 8
    nw = min(warps or warps_for(N, K, U), max_warps(U))
    bounds = [0, *splits, N]
    return _kernel(len(bounds) - 1)(
        inputs=[x, w],
        template=[("OutT", x.dtype), ("NW", nw), ("NT", NT), ("U", U)]
        + [(f"S{i}", int(s)) for i, s in enumerate(splits, start=1)],
        grid=(N // 16 * nw * 32, 1, 1),
        threadgroup=(nw * 32, 1, 1),
        output_shapes=[(M, b - a) for a, b in zip(bounds, bounds[1:])],
        output_dtypes=[x.dtype] * (len(bounds) - 1),
    )
