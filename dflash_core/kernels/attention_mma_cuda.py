"""The exact attention's chunk kernel on tensor cores (bf16 and fp16; head dims 16 to 256).

Same contract as attention_cuda.py's chunk kernel (inputs, outputs, the combine kernel after it):
every query row's bits do not depend on the other rows of the call, so that a decode step and a
verify block give a token the same logits. What makes that hold here:
- one warp holds 16 query rows (a KV head's rows, nrep x L, padded with zero rows), and S = Q K^T
  and O += P V run as mma.m16n8k16 with float32 accumulation, k in a fixed order (the head dim for
  S, the keys for P V): an MMA's element (i, j) depends on row i of A, column j of B and C(i, j)
  only;
- a row's max and sum over a tile are its own lanes' values in a fixed order, then a butterfly over
  the 4 lanes that hold the row (xor 1, 2), so every lane ends with the same bits;
- tiles of TK keys at fixed offsets from slot 0 inside chunks of CHUNK slots, as the scalar kernel's;
  a tile no row of the block sees is skipped, and for a row that sees none of a processed tile it
  adds exactly nothing (alpha = 1, p = 0);
- P is rounded to the input dtype before P V, as flash attention does.
attention_cuda.attention picks this kernel by dtype and head dim only, never by the number of
queries: decode and verify must share it.
"""

from __future__ import annotations

import functools

import mlx.core as mx

DTYPES = (mx.bfloat16, mx.float16)
HEAD_DIMS = (16, 32, 64, 128, 256)  # 512: the scalar kernel (a tile of rows and keys exceeds 48 KB)
SHARED_BYTES = 48 * 1024  # a block's static shared memory

MMA_HEADER = r"""
#define DFLASH_NEG_INF __int_as_float(0xff800000)

template <typename T> struct MmaOf;
template <> struct MmaOf<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  }
};
template <> struct MmaOf<__half> {
  static __device__ __forceinline__ void run(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  }
};

// Four 8x8 matrices of 16-bit elements from shared memory, lane i giving the address of row i % 8
// of matrix i / 8; as stored (A and [n][k] B fragments) or transposed ([k][n] B fragments).
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
"""

# Template: InT (bf16 or fp16), D (64, 128, 256), TK (keys per tile, 16 or 32), WR (warps, 16 query
# rows each), NW (warps per block, >= WR: the ones past WR only load tiles), CHUNK, HAS_MASK, FINAL.
# Inputs and outputs as attention_cuda.py's chunk kernel.
MMA_CHUNKS_SOURCE = r"""
    constexpr int KP = D + 8;        // a row's pitch in shared memory: ldmatrix rows in distinct banks
    constexpr int NT = TK / 8;       // 8-key column tiles of S
    constexpr int KSTEPS = D / 16;   // k steps of S over the head dim
    constexpr int DT = D / 8;        // 8-dim column tiles of O
    constexpr int ROWS = WR * 16;    // query rows per block
    constexpr int THREADS = NW * 32; // NW >= WR warps: all load tiles, the first WR compute
    using Mma = MmaOf<InT>;

    __shared__ __align__(16) InT qs[ROWS * KP];
    __shared__ __align__(16) InT ks[TK * KP];
    __shared__ __align__(16) InT vs[TK * KP];

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;         // the lane's rows in a 16-row tile: g and g + 8
    const int tq = lane & 3;         // its columns in an 8-column tile: 2 tq and 2 tq + 1
    const int Hq = q_shape[1];
    const int L = q_shape[2];
    const int Hkv = k_shape[1];
    const int T = k_shape[2];
    const int nrep = Hq / Hkv;
    const int R = nrep * L;
    const int b = blockIdx.z / Hkv;
    const int hkv = blockIdx.z % Hkv;
    const int c0 = blockIdx.y * CHUNK;
    const int c1 = min(c0 + CHUNK, T);
    const float sm_scale = scale[0];
    const int block_row0 = blockIdx.x * ROWS;

    // The block's query rows into shared memory (rows past R: zeros).
    const bool q_vec = q_strides[3] == 1 && q_strides[2] % 8 == 0 && q_strides[1] % 8 == 0 && q_strides[0] % 8 == 0
                       && reinterpret_cast<size_t>(q) % 16 == 0;
    for (int i = threadIdx.x; i < ROWS * (D / 8); i += THREADS) {
      const int rr = i / (D / 8);
      const int e = (i % (D / 8)) * 8;
      const int r = block_row0 + rr;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < R) {
        const InT* qrow = q + b * q_strides[0] + (hkv * nrep + r / L) * q_strides[1] + (r % L) * q_strides[2];
        if (q_vec) {
          val = *reinterpret_cast<const uint4*>(qrow + e);
        } else {
          InT* vp = reinterpret_cast<InT*>(&val);
          #pragma unroll
          for (int u = 0; u < 8; ++u) vp[u] = qrow[(e + u) * q_strides[3]];
        }
      }
      *reinterpret_cast<uint4*>(qs + rr * KP + e) = val;
    }

    // This lane's two rows.
    int rows_of[2];
    bool real[2];
    const bool* mrow[2] = {nullptr, nullptr};
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      rows_of[h] = block_row0 + warp * 16 + g + 8 * h;
      real[h] = warp < WR && rows_of[h] < R;  // a loading-only warp has no rows
      if constexpr (HAS_MASK) {
        const int r = real[h] ? rows_of[h] : 0;
        const int hq = hkv * nrep + r / L;
        const int qi = r % L;
        mrow[h] = mask + (mask_shape[0] == 1 ? 0 : b) * mask_strides[0] + (mask_shape[1] == 1 ? 0 : hq) * mask_strides[1]
                  + (mask_shape[2] == 1 ? 0 : qi) * mask_strides[2];
      }
    }

    const int kb = k_shape[0] == 1 ? 0 : b;
    const InT* kbase = k + kb * k_strides[0] + hkv * k_strides[1];
    const InT* vbase = v + kb * v_strides[0] + hkv * v_strides[1];
    const bool k_vec = k_strides[3] == 1 && v_strides[3] == 1 && k_strides[2] % 8 == 0 && v_strides[2] % 8 == 0
                       && reinterpret_cast<size_t>(kbase) % 16 == 0 && reinterpret_cast<size_t>(vbase) % 16 == 0;

    float m[2] = {DFLASH_NEG_INF, DFLASH_NEG_INF};  // each row's running max, sum of exponentials
    float l[2] = {0.0f, 0.0f};
    float o[DT][4];                                 // O in the MMA's C layout: [dim tile][row g: 0,1; row g+8: 2,3]
    #pragma unroll
    for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;

    for (int t0 = c0; t0 < c1; t0 += TK) {
      // Which of this lane's scores are seen: [column tile][C element].
      bool sees[NT][4];
      bool any = false;
      #pragma unroll
      for (int n = 0; n < NT; ++n) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int h = c >> 1;
          const int slot = t0 + n * 8 + 2 * tq + (c & 1);
          bool s = real[h] && slot < c1;
          if constexpr (HAS_MASK) s = s && mrow[h][slot * mask_strides[3]];
          sees[n][c] = s;
          any = any || s;
        }
      }
      if (!__syncthreads_or(any)) continue;  // no row of the block sees this tile
      for (int i = threadIdx.x; i < TK * (D / 8); i += THREADS) {
        const int j = i / (D / 8);
        const int e = (i % (D / 8)) * 8;
        const int s = t0 + j;
        uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
        if (s < c1) {
          if (k_vec) {
            kv = *reinterpret_cast<const uint4*>(kbase + s * k_strides[2] + e);
            vv = *reinterpret_cast<const uint4*>(vbase + s * v_strides[2] + e);
          } else {
            InT* kp = reinterpret_cast<InT*>(&kv);
            InT* vp = reinterpret_cast<InT*>(&vv);
            #pragma unroll
            for (int u = 0; u < 8; ++u) {
              kp[u] = kbase[s * k_strides[2] + (e + u) * k_strides[3]];
              vp[u] = vbase[s * v_strides[2] + (e + u) * v_strides[3]];
            }
          }
        }
        *reinterpret_cast<uint4*>(ks + j * KP + e) = kv;
        *reinterpret_cast<uint4*>(vs + j * KP + e) = vv;
      }
      __syncthreads();
      if (__any_sync(0xffffffff, any)) {
        // S = Q K^T over the head dim, k steps in order.
        float s[NT][4];
        #pragma unroll
        for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        const int mi = lane >> 3;  // which 8x8 matrix this lane addresses for ldmatrix
        const int mr = lane & 7;   // and which of its rows
        #pragma unroll
        for (int kstep = 0; kstep < KSTEPS; ++kstep) {
          unsigned a[4];
          ldsm_x4(a, qs + (warp * 16 + (mi & 1) * 8 + mr) * KP + kstep * 16 + (mi >> 1) * 8);
          #pragma unroll
          for (int n = 0; n < NT; n += 2) {
            unsigned kf[4];  // B fragments of column tiles n and n + 1
            ldsm_x4(kf, ks + ((n + (mi >> 1)) * 8 + mr) * KP + kstep * 16 + (mi & 1) * 8);
            Mma::run(s[n], a, kf);
            Mma::run(s[n + 1], a, kf + 2);
          }
        }
        // The rows' max and sum of exponentials over the tile: this lane's, then its group's.
        float tile_max[2] = {DFLASH_NEG_INF, DFLASH_NEG_INF};
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
          #pragma unroll
          for (int c = 0; c < 4; ++c) {
            s[n][c] = sees[n][c] ? __fmul_rn(s[n][c], sm_scale) : DFLASH_NEG_INF;
            tile_max[c >> 1] = fmaxf(tile_max[c >> 1], s[n][c]);
          }
        }
        float alpha[2], m_new[2], sum[2] = {0.0f, 0.0f};
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 1));
          tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 2));
          m_new[h] = fmaxf(m[h], tile_max[h]);
          alpha[h] = m[h] == m_new[h] ? 1.0f : __expf(m[h] - m_new[h]);  // 0 before the first key seen
        }
        unsigned p[NT / 2][4];  // P as A fragments of the P V product (16 keys each), rounded to InT
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
          float e[4];
          #pragma unroll
          for (int c = 0; c < 4; ++c) {
            e[c] = sees[n][c] ? __expf(s[n][c] - m_new[c >> 1]) : 0.0f;
            sum[c >> 1] = __fadd_rn(sum[c >> 1], e[c]);
          }
          p[n >> 1][(n & 1) * 2 + 0] = Mma::pack(e[0], e[1]);  // row g: keys 2 tq, 2 tq + 1 (+ 8 for odd n)
          p[n >> 1][(n & 1) * 2 + 1] = Mma::pack(e[2], e[3]);  // row g + 8
        }
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          sum[h] = __fadd_rn(sum[h], __shfl_xor_sync(0xffffffff, sum[h], 1));
          sum[h] = __fadd_rn(sum[h], __shfl_xor_sync(0xffffffff, sum[h], 2));
          l[h] = __fmaf_rn(l[h], alpha[h], sum[h]);
          m[h] = m_new[h];
        }
        #pragma unroll
        for (int d = 0; d < DT; ++d) {
          o[d][0] = __fmul_rn(o[d][0], alpha[0]);
          o[d][1] = __fmul_rn(o[d][1], alpha[0]);
          o[d][2] = __fmul_rn(o[d][2], alpha[1]);
          o[d][3] = __fmul_rn(o[d][3], alpha[1]);
        }
        // O += P V, 16 keys at a time in order.
        #pragma unroll
        for (int kk = 0; kk < TK / 16; ++kk) {
          #pragma unroll
          for (int d = 0; d < DT; d += 2) {
            unsigned vf[4];  // B fragments of dim tiles d and d + 1, from V stored [key][dim]
            ldsm_x4_trans(vf, vs + (kk * 16 + (mi & 1) * 8 + mr) * KP + (d + (mi >> 1)) * 8);
            Mma::run(o[d], p[kk], vf);
            Mma::run(o[d + 1], p[kk], vf + 2);
          }
        }
      }
      __syncthreads();  // before the next tile overwrites shared memory
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!real[h]) continue;
      const int r = rows_of[h];
      const size_t row = ((size_t)b * L + r % L) * Hq + hkv * nrep + r / L;  // the output row [B, L, Hq]
      if constexpr (FINAL) {
        #pragma unroll
        for (int d = 0; d < DT; ++d) {
          #pragma unroll
          for (int c = 0; c < 2; ++c)
            out[row * D + d * 8 + 2 * tq + c] = static_cast<InT>(l[h] > 0.0f ? __fdiv_rn(o[d][2 * h + c], l[h]) : 0.0f);
        }
      } else {
        const int nc = gridDim.y;
        const size_t at = row * nc + blockIdx.y;
        if (tq == 0) {
          part_m[at] = m[h];
          part_l[at] = l[h];
        }
        #pragma unroll
        for (int d = 0; d < DT; ++d) {
          #pragma unroll
          for (int c = 0; c < 2; ++c) part_o[at * D + d * 8 + 2 * tq + c] = o[d][2 * h + c];
        }
      }
    }
"""

def mma_layout(head_dim: int, rows: int) -> tuple[int, int]:
    """(TK, WR): keys per tile and warps per block (16 query rows each), within static shared memory:
    (WR * 16 + 2 * TK) rows of (head_dim + 8) 2-byte elements."""
    tk = 32 if head_dim <= 128 else 16
    wr = 1
    while wr * 16 < rows and wr < 4 and ((2 * wr) * 16 + 2 * tk) * (head_dim + 8) * 2 <= SHARED_BYTES:
        wr *= 2
    return tk, wr


@functools.cache
def chunks_kernel():
    return mx.fast.cuda_kernel(
        name="dflash_attention_mma_chunks",
        input_names=["q", "k", "v", "mask", "scale"],
        output_names=["out", "part_m", "part_l", "part_o"],
        source=MMA_CHUNKS_SOURCE,
        header=MMA_HEADER,
        ensure_row_contiguous=False,
    )


def takes(dtype: mx.Dtype, head_dim: int) -> bool:
    return dtype in DTYPES and head_dim in HEAD_DIMS
