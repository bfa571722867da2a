"""`x @ dequantize(W).T` for a few rows of x (M <= 16) and 4-bit affine weights, on tensor cores.

A decode step multiplies one row and a verify 16 rows by every weight matrix, so the product is
bound by reading the weights. MLX's CUDA quantized matmul streams 4-bit weights at a fraction of the
card's bandwidth, so a 4-bit verify cost several decode steps (docs/performance.md, "4-bit
weights: our small-M kernel", has the figures). Here
each 4-bit weight is read once, turned into bf16 in registers, and fed to mma.sync m16n8k16.

Layout (MLX's affine format). `w` is [N, K / 8] uint32, nibble j of a word at bits 4j..4j+3;
`scales` and `biases` are [N, K / G]; a weight is `scale * q + bias`. The weight is the MMA's A
operand (16 rows x 16 k) and x the B operand (16 k x 8 tokens). Per 128 k of a row, lane t of a
quad loads 16 bytes (32 nibbles, k = 32t..32t+31) and x's 64 bytes for the same k. A sum over k
does not care about its order, so the fragments use the order the nibbles come out in:
`(w & 0x000F000F) | 0x43004300` is the bf16 pair (128 + q0, 128 + q4), and x's pairs are permuted
to (x0, x4) likewise (`mma_word` says how). 128 + q is exact in bf16; subtracting 128 and one
fused multiply-add with the group's scale and bias give the weight rounded once to bf16.

Work split. A block of NW warps owns 16 * MT weight rows; warp w owns a fixed slice of the K/128
chunks with fp32 accumulators, and the block sums the warps' partials in a fixed order. NW and MT depend
on (N, K) only; M sets the number of token tiles and U (chunks loaded ahead), and a step past a
warp's last chunk multiplies zeros, adding exact zeros. So a token's output is bit-identical
whether it is multiplied alone (decode) or with 15 others (verify).
"""

from __future__ import annotations

import functools

import mlx.core as mx

GROUP_SIZES = (32, 64, 128)
MAX_ROWS = 16
WARP_TARGET = 1024  # warps wanted across the card (132 SMs on the H200) to keep loads in flight

# The tensor-core MMA and the block's fixed-order sum of its warps' partials (into y as OutT, from
# `__shared__ float partial[NW][ROWS][NT * 8]`), shared with the bf16 experiment of the same layout
# (benchmarks/small_m_matmul_cuda.py).
MMA_BF16_16816 = """
__device__ __forceinline__ void mma_bf16_16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""

SUM_WARP_PARTIALS = """
    // Accumulator lane layout: (row g, tokens 2t, 2t+1) and (row g + 8, the same tokens).
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int r = mt * 16 + g;
        const int col = nt * 8 + 2 * t;
        partial[warp][r][col] = acc[mt][nt][0];
        partial[warp][r][col + 1] = acc[mt][nt][1];
        partial[warp][r + 8][col] = acc[mt][nt][2];
        partial[warp][r + 8][col + 1] = acc[mt][nt][3];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS * M; i += NW * 32) {
      const int r = i % ROWS;
      const int token = i / ROWS;
      float sum = 0.0f;
      #pragma unroll
      for (int p = 0; p < NW; ++p) sum += partial[p][r][token];
      y[(size_t)token * N + row0 + r] = static_cast<OutT>(sum);
    }
"""

_HEADER = """
typedef __nv_bfloat16 bf16;
""" + MMA_BF16_16816 + """
__device__ __forceinline__ unsigned as_u32(__nv_bfloat162 v) { return *reinterpret_cast<unsigned*>(&v); }

// Nibbles (shift, shift + 16) of a word as a bf16 pair of weights: scale * q + bias, rounded once.
__device__ __forceinline__ unsigned dequant_pair(unsigned word, int shift, __nv_bfloat162 scale, __nv_bfloat162 bias) {
  const unsigned biased = ((word >> shift) & 0x000F000Fu) | 0x43004300u;  // (128 + q_lo, 128 + q_hi)
  const __nv_bfloat162 q = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased), __float2bfloat162_rn(128.0f));
  return as_u32(__hfma2(q, scale, bias));
}

// x pairs in the nibble order of one word: (x0, x4), (x1, x5), (x2, x6), (x3, x7) from 8 bf16.
__device__ __forceinline__ void permute_x(const uint4& x, unsigned (&p)[4]) {
  p[0] = __byte_perm(x.x, x.z, 0x5410);
  p[1] = __byte_perm(x.x, x.z, 0x7632);
  p[2] = __byte_perm(x.y, x.w, 0x5410);
  p[3] = __byte_perm(x.y, x.w, 0x7632);
}

// One word (8 k) of weight rows g and g + 8 against the same 8 k of a token tile: two 16-k MMAs.
// Lane (g, t) holds logical columns 2t, 2t+1 and 2t+8, 2t+9 of each; step 0 maps them to nibbles
// (0, 4) and (1, 5), step 1 to (2, 6) and (3, 7), in both operands.
__device__ __forceinline__ void mma_word(float* acc, unsigned w_lo, unsigned w_hi, __nv_bfloat162 s_lo,
                                         __nv_bfloat162 b_lo, __nv_bfloat162 s_hi, __nv_bfloat162 b_hi,
                                         const unsigned (&xp)[4]) {
  mma_bf16_16816(acc, dequant_pair(w_lo, 0, s_lo, b_lo), dequant_pair(w_hi, 0, s_hi, b_hi),
                 dequant_pair(w_lo, 4, s_lo, b_lo), dequant_pair(w_hi, 4, s_hi, b_hi), xp[0], xp[1]);
  mma_bf16_16816(acc, dequant_pair(w_lo, 8, s_lo, b_lo), dequant_pair(w_hi, 8, s_hi, b_hi),
                 dequant_pair(w_lo, 12, s_lo, b_lo), dequant_pair(w_hi, 12, s_hi, b_hi), xp[2], xp[3]);
}
"""

# The body for weights w0, w1, ... that share x: their rows are numbered one after another across
# the grid, and `_part_selection` points a block at the weight its rows belong to.
_BODY = """
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int groups = K / G;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;

    // Lane t's 32 k of each 128-k chunk: 4 uint4 of x per token, one uint4 of nibbles per row.
    const uint4* x_rows[NT];
    bool x_real[NT];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int token = nt * 8 + g;
      x_real[nt] = token < M;
      x_rows[nt] = reinterpret_cast<const uint4*>(x + (size_t)(x_real[nt] ? token : 0) * K) + 4 * t;
    }
    const uint4* w_rows[MT][2];
    const bf16* s_rows[MT][2];
    const bf16* b_rows[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const size_t row = row0 + mt * 16 + g + 8 * h;
        w_rows[mt][h] = reinterpret_cast<const uint4*>(w + row * (K / 8)) + t;
        s_rows[mt][h] = scales + row * groups;
        b_rows[mt][h] = biases + row * groups;
      }
    }
    const uint4 zero = make_uint4(0, 0, 0, 0);

    float acc[MT][NT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

    // This warp's 128-k chunks: a split fixed by K and NW alone.
    const int chunks = K / 128;
    const int c_begin = (warp * chunks) / NW;
    const int c_end = ((warp + 1) * chunks) / NW;

    // Weights, scales and biases of U chunks are loaded one step ahead of their MMAs (registers
    // double-buffered), so a warp always has bytes in flight; x, read by every block, comes from
    // L1/L2 at the start of its step.
    uint4 wq[U][MT][2];
    bf16 sc[U][MT][2], bi[U][MT][2];
    auto load_weights = [&](int c0, uint4 (&w_)[U][MT][2], bf16 (&s_)[U][MT][2], bf16 (&b_)[U][MT][2]) {
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u;
        const bool real = c < c_end;
        const int group = (c * 128 + 32 * t) / G;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            w_[u][mt][h] = real ? __ldcs(w_rows[mt][h] + c * 4) : zero;
            s_[u][mt][h] = real ? s_rows[mt][h][group] : bf16(0.0f);
            b_[u][mt][h] = real ? b_rows[mt][h][group] : bf16(0.0f);
          }
      }
    };
    load_weights(c_begin, wq, sc, bi);

    for (int c0 = c_begin; c0 < c_end; c0 += U) {
      uint4 xv[U][NT][4];
      #pragma unroll
      for (int u = 0; u < U; ++u)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          #pragma unroll
          for (int j = 0; j < 4; ++j)
            xv[u][nt][j] = (c0 + u < c_end && x_real[nt]) ? __ldg(x_rows[nt] + (c0 + u) * 16 + j) : zero;
      uint4 wq_next[U][MT][2];
      bf16 sc_next[U][MT][2], bi_next[U][MT][2];
      load_weights(c0 + U, wq_next, sc_next, bi_next);
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          unsigned xp[NT][4];
          #pragma unroll
          for (int nt = 0; nt < NT; ++nt) permute_x(xv[u][nt][j], xp[nt]);
          #pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const uint4& lo = wq[u][mt][0];
            const uint4& hi = wq[u][mt][1];
            const unsigned w_lo = j == 0 ? lo.x : j == 1 ? lo.y : j == 2 ? lo.z : lo.w;
            const unsigned w_hi = j == 0 ? hi.x : j == 1 ? hi.y : j == 2 ? hi.z : hi.w;
            const __nv_bfloat162 s_lo = __bfloat162bfloat162(sc[u][mt][0]), b_lo = __bfloat162bfloat162(bi[u][mt][0]);
            const __nv_bfloat162 s_hi = __bfloat162bfloat162(sc[u][mt][1]), b_hi = __bfloat162bfloat162(bi[u][mt][1]);
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma_word(acc[mt][nt], w_lo, w_hi, s_lo, b_lo, s_hi, b_hi, xp[nt]);
          }
        }
      }
      #pragma unroll
      for (int u = 0; u < U; ++u)
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            wq[u][mt][h] = wq_next[u][mt][h];
            sc[u][mt][h] = sc_next[u][mt][h];
            bi[u][mt][h] = bi_next[u][mt][h];
          }
    }

    __shared__ float partial[NW][ROWS][NT * 8];
""" + SUM_WARP_PARTIALS


def _part_selection(parts: int) -> str:
    """Point this block's `w`, `scales`, `biases`, `y`, `N` and first row at the weight it works
    on: every weight's row count is a multiple of ROWS, so a block never straddles two."""
    lines = [
        "    constexpr int ROWS = 16 * MT;",
        "    int row0 = blockIdx.x * ROWS;",
        "    auto w = w0; auto scales = scales0; auto biases = biases0; auto y = y0;",
        "    int N = w0_shape[0];",
    ]
    for i in range(1, parts):
        lines.append(f"    if (row0 >= N) {{ row0 -= N; w = w{i}; scales = scales{i}; biases = biases{i}; y = y{i}; "
                     f"N = w{i}_shape[0]; }}")
    return "\n".join(lines) + "\n"


def _input_names(parts: int) -> list[str]:
    return ["x"] + [f"{name}{i}" for i in range(parts) for name in ("w", "scales", "biases")]


@functools.cache
def _kernel(parts: int):
    return mx.fast.cuda_kernel(
        name=f"dflash_q4_small_m_matmul_{parts}",
        input_names=_input_names(parts),
        output_names=[f"y{i}" for i in range(parts)],
        source=_part_selection(parts) + _BODY,
        header=_HEADER,
    )


@functools.cache
def has_bf16_mma() -> bool:
    """mma.sync m16n8k16 with bf16 operands needs compute capability 8.0 (Ampere) or newer. Devices
    that do not report one (the CPU, MLX builds that do not say) are not refused here: the backend
    gate decides where CUDA kernels run at all."""
    major = mx.device_info().get("compute_capability_major")
    return major is None or int(major) >= 8


def supported(rows: int, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
              mode: str) -> bool:
    """bf16 x with 1..16 rows against 4-bit affine [N, K] weights (uint32 words) with bf16 scales
    and biases [N, K / group_size], K a multiple of 128 and N of 16, on an Ampere or newer GPU."""
    n, k = w.shape[0], x.shape[-1]
    return (
        1 <= rows <= MAX_ROWS
        and bits == 4
        and mode == "affine"
        and group_size in GROUP_SIZES
        and x.dtype == mx.bfloat16
        and w.dtype == mx.uint32
        and scales.dtype == biases.dtype == mx.bfloat16
        and w.ndim == 2
        and w.shape[1] * 8 == k
        and k % 128 == 0
        and n % 16 == 0
        and scales.shape == biases.shape == (n, k // group_size)
        and has_bf16_mma()
    )


def launch_shape(ns: tuple[int, ...], k: int, m: int = 1) -> tuple[int, int, int]:
    """(NW warps per block splitting K, MT 16-row tiles per warp, U chunks loaded ahead) for
    weights of N = ns rows each and K columns, multiplied by M rows in one launch. NW fixes the
    order of the sum over K, so it depends on the weights' shapes only: a token's output must not
    depend on M. MT and U change which registers and when, not the arithmetic. Set after the
    kernel-only sweep on the H200 (SWEEP=1 benchmarks/gpu_small_m_q4.sh, docs/performance.md): two row tiles;
    warps enough for WARP_TARGET across the card, at most 8 (weights of 4096 rows: 8 warps made the
    MLP's down projection 1.5-1.8x faster than 4, the larger weights gain nothing past 4); two chunks
    ahead, except for 16 rows with fewer than 4 warps (the register cost there was not measured to pay)."""
    mt = 2 if all(n % 32 == 0 for n in ns) else 1
    blocks = sum(ns) // (16 * mt)
    nw = max(1, min(8, k // 128, -(-WARP_TARGET // blocks)))
    return nw, mt, 2 if m <= 8 or nw >= 4 else 1


def quantized_matmuls_cuda(x: mx.array, weights: list[tuple[mx.array, mx.array, mx.array]], group_size: int,
                           shape: tuple[int, int, int] | None = None) -> list[mx.array]:
    """[x @ dequantize(w, scales, biases).T for each weight], in one launch: x [M, K] bf16, each
    w [N_i, K/8] -> [M, N_i] bf16. Weights that share an input (q, k, v; gate, up) go together,
    because a launch costs about as much as streaming a small weight (docs/performance.md)."""
    m, k = x.shape
    ns = tuple(w.shape[0] for w, _, _ in weights)
    nw, mt, u = shape or launch_shape(ns, k, m)
    return _kernel(len(weights))(
        inputs=[x] + [a for weight in weights for a in weight],
        template=[("OutT", mx.bfloat16), ("G", group_size), ("NW", nw), ("MT", mt), ("U", u), ("NT", (m + 7) // 8)],
        grid=(sum(ns) // (16 * mt) * nw * 32, 1, 1),
        threadgroup=(nw * 32, 1, 1),
        output_shapes=[(m, n) for n in ns],
        output_dtypes=[mx.bfloat16] * len(ns),
    )


def quantized_matmul_cuda(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                          shape: tuple[int, int, int] | None = None) -> mx.array:
    """x [M, K] (bf16) @ dequantize(w [N, K/8], scales, biases).T -> [M, N] bf16."""
    return quantized_matmuls_cuda(x, [(w, scales, biases)], group_size, shape)[0]
