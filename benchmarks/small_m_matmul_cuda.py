"""An experiment, not used by the engine: `x @ w.T` for a few rows of x (M <= 16) on tensor cores.

A decode step multiplies one row and a verify 16 rows by every weight matrix, so the product is
bound by reading the weights. MLX's GEMM for such shapes streams 1.3-2.9 TB/s on the H200. These
two kernels were written to beat it and, measured by gpu_kernels.py (docs/performance.md,
"Weight streaming"), did not do so reliably, so the engine keeps MLX's GEMM. They are kept, exact
and row-invariant, as the starting point for that work.

Layout. The operands are swapped: the weight is the MMA's A operand (16 weight rows x 16 k) and
x the B operand (16 k x 8 tokens), so no tensor-core row is wasted on padding tokens; 16 tokens
are two 8-token tiles sharing each weight fragment. Every lane loads 16 contiguous bytes of a
weight row and of an x row per 32 k; as a sum over k does not care about its order, the lanes'
k indices are permuted identically in both operands so that these wide loads feed the MMA
fragments directly (`mma_32k` says how).

Work split. A block of NW warps owns 16 * MT weight rows; warp w owns a fixed slice of the K/32
chunks and keeps fp32 accumulators; the block sums the warps' partials in a fixed order through
shared memory. Nothing depends on M but the number of token tiles, so a token's output is
bit-identical whether it is multiplied alone (decode) or with 15 others (verify).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from dflash_core.kernels.quantized_matmul_cuda import MMA_BF16_16816, SUM_WARP_PARTIALS

# Defaults for gpu_kernels.py's exactness rows; its streaming rows sweep the others.
VARIANT = "pipelined"  # or "direct": fragments loaded straight from global memory
WARPS = 2  # NW: warps per block, splitting K
ROW_TILES = 1  # MT: 16-row weight tiles per warp
DEPTH = 4  # pipelined: STAGES of the cp.async ring; direct: U, 32-k chunks loaded before the MMAs

_HEADER = """
__device__ __forceinline__ void cp_async_16(void* shared_dst, const void* global_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(dst), "l"(global_src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\\n" ::"n"(N)); }

""" + MMA_BF16_16816 + """
// One 32-k chunk: lane (g = lane / 4, t = lane % 4) holds k = 8t..8t+7 of weight rows g and g + 8
// (w_lo, w_hi) and of token g (x_tok). The m16n8k16 fragments want, for lane (g, t), columns
// 2t, 2t+1 and 2t+8, 2t+9 of a 16-k step; mapping step s's logical column 2t+j to physical
// 8t+4s+j and 2t+8+j to 8t+4s+2+j (j = 0, 1) covers the 32 k exactly once over s = 0, 1, the
// same way in both operands. Words (32-bit pairs) 2s and 2s+1 of each load are those columns.
template <int MT, int NT>
__device__ __forceinline__ void mma_32k(float (&acc)[MT][NT][4], const uint4 (&w)[MT][2], const uint4 (&x)[NT]) {
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mma_bf16_16816(acc[mt][nt], w[mt][0].x, w[mt][1].x, w[mt][0].y, w[mt][1].y, x[nt].x, x[nt].y);
      mma_bf16_16816(acc[mt][nt], w[mt][0].z, w[mt][1].z, w[mt][0].w, w[mt][1].w, x[nt].z, x[nt].w);
    }
  }
}
"""

_COMMON = """
    constexpr int ROWS = 16 * MT;
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int row0 = blockIdx.x * ROWS;
    const uint4* x_rows[NT];
    bool x_real[NT];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int token = nt * 8 + g;
      x_real[nt] = token < M;
      x_rows[nt] = reinterpret_cast<const uint4*>(x + (size_t)(x_real[nt] ? token : 0) * K) + t;
    }
    const uint4 zero = make_uint4(0, 0, 0, 0);

    float acc[MT][NT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
"""

_SOURCE_DIRECT = _COMMON + """

    // This warp's 32-k chunks: a split fixed by K and NW alone.
    const int chunks = K / 32;
    const int c_begin = (warp * chunks) / NW;
    const int c_end = ((warp + 1) * chunks) / NW;

    const uint4* w_rows[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      w_rows[mt][0] = reinterpret_cast<const uint4*>(w + (size_t)(row0 + mt * 16 + g) * K) + t;
      w_rows[mt][1] = reinterpret_cast<const uint4*>(w + (size_t)(row0 + mt * 16 + g + 8) * K) + t;
    }

    int c = c_begin;
    for (; c + U <= c_end; c += U) {
      uint4 wf[U][MT][2];
      uint4 xf[U][NT];
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          wf[u][mt][0] = __ldcs(w_rows[mt][0] + (c + u) * 4);
          wf[u][mt][1] = __ldcs(w_rows[mt][1] + (c + u) * 4);
        }
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) xf[u][nt] = x_real[nt] ? __ldg(x_rows[nt] + (c + u) * 4) : zero;
      }
      #pragma unroll
      for (int u = 0; u < U; ++u) mma_32k<MT, NT>(acc, wf[u], xf[u]);
    }
    for (; c < c_end; ++c) {
      uint4 wf[MT][2];
      uint4 xf[NT];
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        wf[mt][0] = __ldcs(w_rows[mt][0] + c * 4);
        wf[mt][1] = __ldcs(w_rows[mt][1] + c * 4);
      }
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) xf[nt] = x_real[nt] ? __ldg(x_rows[nt] + c * 4) : zero;
      mma_32k<MT, NT>(acc, wf, xf);
    }
    __shared__ float partial[NW][ROWS][NT * 8];
"""


# Each warp streams its weight tiles (ROWS rows x 128 k; 256 contiguous bytes per row, two rows per
# load instruction) into its own shared-memory ring with cp.async, STAGES - 1 tiles ahead of the
# MMAs; x, which every block reads, comes from L1/L2 one tile ahead.
_SOURCE_PIPELINED = _COMMON + """
    constexpr int KT = 128;
    constexpr int SUB = KT / 32;

    const int tiles = K / KT;
    const int t_begin = (warp * tiles) / NW;
    const int t_end = ((warp + 1) * tiles) / NW;

    __shared__ uint4 ring[NW][STAGES][ROWS][KT / 8];
    __shared__ float partial[NW][ROWS][NT * 8];

    auto issue = [&](int tile, int slot) {
      #pragma unroll
      for (int q = 0; q < ROWS / 2; ++q) {
        const int r = 2 * q + (lane >> 4);
        const int chunk = lane & 15;
        cp_async_16(&ring[warp][slot][r][chunk], w + (size_t)(row0 + r) * K + (size_t)tile * KT + chunk * 8);
      }
    };
    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (t_begin + s < t_end) issue(t_begin + s, s);
      cp_async_commit();
    }

    uint4 x_next[SUB][NT];
    #pragma unroll
    for (int j = 0; j < SUB; ++j)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        x_next[j][nt] = (x_real[nt] && t_begin < t_end) ? __ldg(x_rows[nt] + t_begin * (KT / 8) + 4 * j) : zero;

    for (int tile = t_begin; tile < t_end; ++tile) {
      const int ahead = tile + STAGES - 1;
      if (ahead < t_end) issue(ahead, (ahead - t_begin) % STAGES);
      cp_async_commit();
      uint4 x_now[SUB][NT];
      #pragma unroll
      for (int j = 0; j < SUB; ++j)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          x_now[j][nt] = x_next[j][nt];
          x_next[j][nt] = (x_real[nt] && tile + 1 < t_end) ? __ldg(x_rows[nt] + (tile + 1) * (KT / 8) + 4 * j) : zero;
        }
      cp_async_wait<STAGES - 1>();
      __syncwarp();
      const int slot = (tile - t_begin) % STAGES;
      #pragma unroll
      for (int j = 0; j < SUB; ++j) {
        uint4 wf[MT][2];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          wf[mt][0] = ring[warp][slot][mt * 16 + g][4 * j + t];
          wf[mt][1] = ring[warp][slot][mt * 16 + g + 8][4 * j + t];
        }
        mma_32k<MT, NT>(acc, wf, x_now[j]);
      }
      __syncwarp();  // the slot is refilled next iteration
    }
"""

_REDUCE = SUM_WARP_PARTIALS


@functools.cache
def _kernel(variant: str):
    source = {"direct": _SOURCE_DIRECT, "pipelined": _SOURCE_PIPELINED}[variant]
    return mx.fast.cuda_kernel(
        name=f"dflash_small_m_matmul_{variant}",
        input_names=["x", "w"],
        output_names=["y"],
        source=source + _REDUCE,
        header=_HEADER,
    )


def supported(rows: int, x_dtype: mx.Dtype, w: mx.array) -> bool:
    """bf16 x [rows <= 16, K] and w [N, K] with K a multiple of 128 and N of the block's rows."""
    return (
        1 <= rows <= 16
        and x_dtype == mx.bfloat16
        and w.dtype == mx.bfloat16
        and w.ndim == 2
        and w.shape[1] % 128 == 0
        and w.shape[0] % (16 * ROW_TILES) == 0
    )


def matmul_cuda(x: mx.array, w: mx.array, variant: str = VARIANT, warps: int = WARPS, row_tiles: int = ROW_TILES,
                depth: int = DEPTH) -> mx.array:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype (bf16)."""
    M = x.shape[0]
    N = w.shape[0]
    rows = 16 * row_tiles
    return _kernel(variant)(
        inputs=[x, w],
        template=[("OutT", x.dtype), ("NW", warps), ("MT", row_tiles), ("NT", (M + 7) // 8),
                  ("STAGES" if variant == "pipelined" else "U", depth)],
        grid=(N // rows * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )[0]
