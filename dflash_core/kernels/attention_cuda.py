"""A decode step's and a verify block's attention on CUDA, each query row rounded the same whatever
else shares the call.

Lossless speculative decoding needs a token's logits to be the same bits whether the target computes
them in a 1-token decode step or in a 16-token verify. MLX's fused attention (one query) and the
stacked GEMMs of attention.py (a block) round differently from each other, and cuBLASLt picks its
algorithm by shape, so in bf16 a near-tie could go either way and DFlash's output could part from
the target's own (docs/performance.md, "Attention that rounds a row alone"). Here every query row is
one warp's work, summed in an order fixed by the key's slot in the cache alone:

- Keys are cut into chunks of `CHUNK` slots counted from slot 0, and each chunk into tiles of TK
  (32, fewer for rows wider than 512 bytes: `tile_keys`). Which chunks and tiles exist depends on the buffer's length, but a
  query's sums only take the keys it sees; a tile or chunk it sees nothing of adds nothing (it is
  skipped, and an exact zero added to a float changes nothing). So the same query over a buffer of
  any length, or beside any other queries or batch rows, gets the same bits.
- In a tile, lane j scores key j over the head dim in a fixed order, the warp takes the tile's max
  and its sum of exponentials by a butterfly (the same tree for every tile), and each lane adds the
  tile's values to its slice of the head dim in key order (an online softmax, as flash attention).
- One thread block per (row group, chunk, batch row x KV head); a second kernel combines a row's
  chunks in chunk order. Where the buffer is one chunk long the first kernel finishes the row
  itself, with the same arithmetic the combination does on one chunk (a weight of exp(0) = 1).

Scores and the softmax are float32, and so are the values' sums (p times the value, as the value
dtype rounds it); the output is rounded once to the input dtype. No gradient: training's blocks go
through attention.py's paths.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from . import attention_mma_cuda

CHUNK = 128  # key slots per thread block: fixed, so a query's sums never depend on the buffer's length
MIN_CHUNK = 32  # a multiple of every tile's keys (TK)
MAX_QUERIES = 16
MAX_GRID = 65535  # blocks along a CUDA grid's y and z axes
MAX_ROWS_PER_BLOCK = 16  # warps (query rows) per block: they share each loaded tile of keys and values
HEAD_DIMS = (16, 32, 64, 128, 256, 512)

_HEADER = """
#define DFLASH_NEG_INF __int_as_float(0xff800000)

template <int BYTES> struct VecOf;
template <> struct VecOf<16> { using type = uint4; };
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<4> { using type = unsigned; };
template <> struct VecOf<2> { using type = unsigned short; };

template <typename T>
__device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }

// The max and the sum of a value over a warp, by one butterfly: every lane ends with the same bits.
__device__ __forceinline__ float warp_max(float x) {
  #pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, off));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  #pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = __fadd_rn(x, __shfl_xor_sync(0xffffffff, x, off));
  return x;
}
"""

# Template: InT (q, k, v dtype), D, TK (keys per tile), W (warps = rows per block), HAS_MASK, FINAL
# (the buffer is one chunk: write the output, not the chunk's partials). Inputs q [B, Hq, L, D],
# k and v [1 or B, Hkv, T, D], mask [1 or B, 1 or Hq, 1 or L, T] (bool), scale (a float32 scalar).
_CHUNKS_SOURCE = """
    constexpr int LPK = 32 / TK;          // lanes per key when scoring a tile
    constexpr int QK_DIMS = D / LPK;      // head dims each of them sums
    constexpr int DPL = D >= 32 ? D / 32 : 1;  // head dims of the output each lane owns (D 16: half the lanes)
    constexpr int PAD = 4 / sizeof(InT);  // one 32-bit word after each key's row: a tile's keys in distinct banks
    constexpr int KROW = D + PAD;
    constexpr int VEC = 16 / sizeof(InT); // elements per 16-byte load
    constexpr int VBYTES = DPL * sizeof(InT) >= 16 ? 16 : DPL * sizeof(InT);
    using VecT = typename VecOf<VBYTES>::type;
    constexpr int NV = DPL * sizeof(InT) / VBYTES;

    __shared__ __align__(16) unsigned char smem[(TK * KROW + TK * D + W * D) * sizeof(InT)];
    InT* ks = reinterpret_cast<InT*>(smem);  // the tile's keys, [TK][KROW]
    InT* vs = ks + TK * KROW;                // its values, [TK][D]
    InT* qs = vs + TK * D;                   // the block's query rows, [W][D]

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int Hq = q_shape[1];
    const int L = q_shape[2];
    const int Hkv = k_shape[1];
    const int T = k_shape[2];
    const int nrep = Hq / Hkv;
    const int R = nrep * L;                  // query rows per KV head
    const int b = blockIdx.z / Hkv;
    const int hkv = blockIdx.z % Hkv;
    const int r = blockIdx.x * W + warp;
    const bool real = r < R;
    const int hq = hkv * nrep + (real ? r / L : 0);
    const int qi = real ? r % L : 0;
    const int c0 = blockIdx.y * CHUNK;
    const int c1 = min(c0 + CHUNK, T);
    const float sm_scale = scale[0];

    const InT* qrow = q + b * q_strides[0] + hq * q_strides[1] + qi * q_strides[2];
    for (int d = lane; d < D; d += 32) qs[warp * D + d] = qrow[d * q_strides[3]];

    const int kb = k_shape[0] == 1 ? 0 : b;
    const InT* kbase = k + kb * k_strides[0] + hkv * k_strides[1];
    const InT* vbase = v + kb * v_strides[0] + hkv * v_strides[1];
    // 16-byte loads where every key row starts 16-byte aligned; else one element at a time.
    const bool k_vec = k_strides[3] == 1 && v_strides[3] == 1 && k_strides[2] % VEC == 0 && v_strides[2] % VEC == 0
                       && reinterpret_cast<size_t>(kbase) % 16 == 0 && reinterpret_cast<size_t>(vbase) % 16 == 0;
    const bool* mrow = nullptr;
    if constexpr (HAS_MASK) {
      mrow = mask + (mask_shape[0] == 1 ? 0 : b) * mask_strides[0] + (mask_shape[1] == 1 ? 0 : hq) * mask_strides[1]
             + (mask_shape[2] == 1 ? 0 : qi) * mask_strides[2];
    }

    float m = DFLASH_NEG_INF;  // the row's running max, sum of exponentials and weighted values
    float l = 0.0f;
    float o[DPL];
    #pragma unroll
    for (int i = 0; i < DPL; ++i) o[i] = 0.0f;

    const int jj = lane / LPK;   // this lane's key in a tile
    const int part = lane % LPK; // and which part of the head dim it sums
    for (int t0 = c0; t0 < c1; t0 += TK) {
      const int slot = t0 + jj;
      bool sees = real && slot < c1;
      if constexpr (HAS_MASK) sees = sees && mrow[slot * mask_strides[3]];
      if (!__syncthreads_or(sees)) continue;  // no row of the block sees this tile
      // The tile's keys and values into shared memory (slots past the chunk: zeros, never read).
      for (int i = threadIdx.x; i < TK * (D / VEC); i += W * 32) {
        const int j = i / (D / VEC);
        const int e = (i % (D / VEC)) * VEC;
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
            for (int u = 0; u < VEC; ++u) {
              kp[u] = kbase[s * k_strides[2] + (e + u) * k_strides[3]];
              vp[u] = vbase[s * v_strides[2] + (e + u) * v_strides[3]];
            }
          }
        }
        const unsigned* kw = reinterpret_cast<const unsigned*>(&kv);
        unsigned* kdst = reinterpret_cast<unsigned*>(ks + j * KROW + e);
        #pragma unroll
        for (int u = 0; u < 4; ++u) kdst[u] = kw[u];
        *reinterpret_cast<uint4*>(vs + j * D + e) = vv;
      }
      __syncthreads();
      if (__any_sync(0xffffffff, sees)) {
        // Score: this lane's key over its part of the head dim, in order.
        const InT* krow = ks + jj * KROW + part * QK_DIMS;
        const InT* qd = qs + warp * D + part * QK_DIMS;
        float s = 0.0f;
        #pragma unroll 8
        for (int d = 0; d < QK_DIMS; ++d) s = __fmaf_rn(to_float(qd[d]), to_float(krow[d]), s);
        #pragma unroll
        for (int off = 1; off < LPK; off <<= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffff, s, off));
        s = sees ? __fmul_rn(s, sm_scale) : DFLASH_NEG_INF;
        const float m_new = fmaxf(m, warp_max(s));
        const float alpha = m == m_new ? 1.0f : __expf(m - m_new);  // 0 before the first key seen
        const float p = sees ? __expf(s - m_new) : 0.0f;
        l = __fmaf_rn(l, alpha, warp_sum(part == 0 ? p : 0.0f));
        #pragma unroll
        for (int i = 0; i < DPL; ++i) o[i] = __fmul_rn(o[i], alpha);
        for (int j = 0; j < TK; ++j) {
          const float pj = __shfl_sync(0xffffffff, p, j * LPK);
          if (pj == 0.0f) continue;  // unseen (or underflowed): adds nothing; the same for the whole warp
          if (lane * DPL >= D) continue;
          alignas(16) InT vals[DPL];
          #pragma unroll
          for (int u = 0; u < NV; ++u)
            reinterpret_cast<VecT*>(vals)[u] = reinterpret_cast<const VecT*>(vs + j * D + lane * DPL)[u];
          #pragma unroll
          for (int i = 0; i < DPL; ++i) o[i] = __fmaf_rn(pj, to_float(vals[i]), o[i]);
        }
        m = m_new;
      }
      __syncthreads();  // before the next tile overwrites shared memory
    }
    if (!real || lane * DPL >= D) return;
    const size_t row = ((size_t)b * L + qi) * Hq + hq;  // the output row [B, L, Hq]
    if constexpr (FINAL) {
      #pragma unroll
      for (int i = 0; i < DPL; ++i)
        out[row * D + lane * DPL + i] = static_cast<InT>(l > 0.0f ? __fdiv_rn(o[i], l) : 0.0f);
    } else {
      const int nc = gridDim.y;
      const size_t at = row * nc + blockIdx.y;
      if (lane == 0) {
        part_m[at] = m;
        part_l[at] = l;
      }
      #pragma unroll
      for (int i = 0; i < DPL; ++i) part_o[at * D + lane * DPL + i] = o[i];
    }
"""

# One warp per output row: its chunks' partials (part_m, part_l [rows, NC], part_o [rows, NC, D])
# combined in chunk order, the chunks it saw nothing of skipped.
_COMBINE_SOURCE = """
    constexpr int DPL = D >= 32 ? D / 32 : 1;
    const int lane = threadIdx.x & 31;
    const size_t row = (size_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int nc = part_m_shape[1];
    if (row >= (size_t)part_m_shape[0]) return;
    const float* pm = part_m + row * nc;
    const float* pl = part_l + row * nc;
    float m = DFLASH_NEG_INF;
    for (int c = lane; c < nc; c += 32) if (pl[c] > 0.0f) m = fmaxf(m, pm[c]);
    m = warp_max(m);
    float l = 0.0f;
    float o[DPL];
    #pragma unroll
    for (int i = 0; i < DPL; ++i) o[i] = -0.0f;  // the exact additive identity: a lone chunk's -0 stays -0
    if (lane * DPL >= D) return;  // (D 16: half the lanes own nothing; no shuffles follow)
    for (int c = 0; c < nc; ++c) {
      if (!(pl[c] > 0.0f)) continue;
      const float w = pm[c] == m ? 1.0f : __expf(pm[c] - m);  // 1 for a row's one chunk, as FINAL
      l = __fmaf_rn(pl[c], w, l);
      const float* po = part_o + (row * nc + c) * D + lane * DPL;
      #pragma unroll
      for (int i = 0; i < DPL; ++i) o[i] = __fmaf_rn(po[i], w, o[i]);
    }
    #pragma unroll
    for (int i = 0; i < DPL; ++i)
      out[row * D + lane * DPL + i] = static_cast<OutT>(l > 0.0f ? __fdiv_rn(o[i], l) : 0.0f);
"""


@functools.cache
def _chunks_kernel():
    return mx.fast.cuda_kernel(
        name="dflash_attention_chunks",
        input_names=["q", "k", "v", "mask", "scale"],
        output_names=["out", "part_m", "part_l", "part_o"],
        source=_CHUNKS_SOURCE,
        header=_HEADER,
        ensure_row_contiguous=False,
    )


@functools.cache
def _combine_kernel():
    return mx.fast.cuda_kernel(
        name="dflash_attention_combine",
        input_names=["part_m", "part_l", "part_o"],
        output_names=["out"],
        source=_COMBINE_SOURCE,
        header=_HEADER,
    )


def supported(q: mx.array, k: mx.array, v: mx.array, mask, chunk: int = CHUNK) -> bool:
    """q [B, Hq, 1..16, D], k and v [1 or B, Hkv, T, D] of q's dtype (bf16, fp16 or fp32), D one of
    HEAD_DIMS, and no mask or a boolean one, [L, T] or [1 or B, 1 or Hq, 1 or L, T]; within CUDA's
    grid limits (chunks of `chunk` slots and B x Hkv at most 65535 blocks)."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or v.dtype != k.dtype:
        return False
    return _takes(q, k, k.shape[2], mask, chunk)


def supported_segments(q: mx.array, keys, values, mask, chunk: int = CHUNK) -> bool:
    """`supported` for the keys and values that segments [.., T_i, D] joined on their slot axis
    would make, from their shapes: whether joining them is worth it (the kernel takes one segment)."""
    if q.ndim != 4 or not keys or len(keys) != len(values):
        return False
    k0 = keys[0]
    if any(k.ndim != 4 or v.shape != k.shape or k.shape[:2] + k.shape[3:] != k0.shape[:2] + k0.shape[3:]
           or k.dtype != k0.dtype or v.dtype != k0.dtype for k, v in zip(keys, values)):
        return False
    return _takes(q, k0, sum(k.shape[2] for k in keys), mask, chunk)


def _takes(q: mx.array, k: mx.array, T: int, mask, chunk: int) -> bool:
    """`supported`'s checks of q, the mask and keys shaped as `k` (4-d, values alike) but T slots long."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    if not (B >= 1 and 1 <= L <= MAX_QUERIES and D in HEAD_DIMS and k.shape[3] == D and k.shape[0] in (1, B)
            and Hkv > 0 and Hq % Hkv == 0 and 0 < T <= MAX_GRID * chunk and B * Hkv <= MAX_GRID):
        return False
    if q.dtype not in (mx.bfloat16, mx.float16, mx.float32) or k.dtype != q.dtype:
        return False
    if mask is None:
        return True
    if not (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim in (2, 4)):
        return False  # (a 3-d mask: MLX reads its first axis as heads, so it is not guessed at here)
    mb, mh, ml, mt = (1, 1, *mask.shape) if mask.ndim == 2 else mask.shape  # (as `_mask4` lays it out)
    return mb in (1, B) and mh in (1, Hq) and ml in (1, L) and mt == T


@functools.lru_cache(maxsize=64)
def _scale(value: float) -> mx.array:
    """The kernel's scale as a float32 scalar made once per value (a layer's scale is a constant):
    an array made at every call is host work and, on a GPU, a copy each layer of every forward."""
    return mx.array(value, mx.float32)


@functools.cache
def _no_mask() -> mx.array:
    """The mask input of a call without a mask (never read: HAS_MASK is off), made from data once,
    not an op (`mx.zeros` would be a launch each call)."""
    return mx.array([[[[False]]]])


def _mask4(mask: mx.array) -> mx.array:
    """[L, T] as [1, 1, L, T]; a 4-d mask as it is."""
    return mask[None, None] if mask.ndim == 2 else mask


SHARED_BYTES = 48 * 1024  # a block's static shared memory


def tile_keys(head_dim: int, dtype: mx.Dtype) -> int:
    """Keys per tile: 32 while a key's row is at most 512 bytes, fewer for wider rows (shared memory)."""
    row = head_dim * dtype.size
    return 32 if row <= 512 else 16 if row <= 1024 else 8


def rows_per_block(rows: int, head_dim: int, dtype: mx.Dtype) -> int:
    """Warps (query rows) per block: a power of two up to the call's rows and MAX_ROWS_PER_BLOCK,
    within the shared memory left by a tile's keys and values. Only the layout depends on it."""
    size = dtype.size
    tk = tile_keys(head_dim, dtype)
    tile = tk * (head_dim + 4 // size) * size + tk * head_dim * size
    W = 1
    while W < min(rows, MAX_ROWS_PER_BLOCK) and tile + 2 * W * head_dim * size <= SHARED_BYTES:
        W *= 2
    return W


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Optional[mx.array] = None,
              tensor_cores: bool = True, chunk: int = CHUNK, load_warps: int = 1) -> mx.array:
    """softmax(q k^T * scale, over the keys `mask` shows each query; all of them without one) v,
    [B, Hq, L, D] in q's dtype, for inputs `supported` takes. A query that sees no key gets zeros.
    Written token-major, [B, L, Hq, D], and returned as its transposed view: the callers' next step
    (heads back after the tokens, then one row a token) is then a view too, where the heads-first
    layout made it a copy for every block of more than one query (a launch a layer in a verify and
    a draft, none in a decode step, whose two layouts are one).
    `tensor_cores`: bf16/fp16 head dims the tensor-core kernel takes go through it, else through
    the scalar one; `chunk`: key slots per block (a multiple of MIN_CHUNK). A decode and
    a verify must pass the same of both. `load_warps`: warps per block of the tensor-core kernel
    at least, the ones past its computing warps only loading tiles (the same bits: a decode step's
    block has one computing warp, which otherwise loads each tile alone)."""
    if chunk % MIN_CHUNK or chunk < MIN_CHUNK:
        raise ValueError(f"chunk must be a positive multiple of {MIN_CHUNK}, not {chunk}")
    if -(-k.shape[2] // chunk) > MAX_GRID:
        raise ValueError(f"{k.shape[2]} key slots are more than {MAX_GRID} chunks of {chunk}")
    B, Hq, L, D = q.shape
    T = k.shape[2]
    rows = Hq // k.shape[1] * L  # query rows per KV head
    chunks = -(-T // chunk)
    has_mask = mask is not None
    mask = _mask4(mask) if has_mask else _no_mask()
    final = chunks == 1
    n = B * Hq * L
    outputs = dict(output_shapes=[(B, L, Hq, D) if final else (1,), (1,) if final else (n, chunks),
                                  (1,) if final else (n, chunks), (1,) if final else (n, chunks, D)],
                   output_dtypes=[q.dtype, mx.float32, mx.float32, mx.float32])
    inputs = [q, k, v, mask, _scale(float(scale))]
    if tensor_cores and attention_mma_cuda.takes(q.dtype, D):  # by dtype and head dim: decode and verify alike
        TK, WR = attention_mma_cuda.mma_layout(D, rows)
        NW = max(WR, load_warps)
        out, part_m, part_l, part_o = attention_mma_cuda.chunks_kernel()(
            inputs=inputs, template=[("InT", q.dtype), ("D", D), ("TK", TK), ("WR", WR), ("NW", NW), ("CHUNK", chunk),
                                     ("HAS_MASK", has_mask), ("FINAL", final)],
            grid=(-(-rows // (WR * 16)) * NW * 32, chunks, B * k.shape[1]), threadgroup=(NW * 32, 1, 1), **outputs)
    else:
        TK, W = tile_keys(D, q.dtype), rows_per_block(rows, D, q.dtype)
        out, part_m, part_l, part_o = _chunks_kernel()(
            inputs=inputs, template=[("InT", q.dtype), ("D", D), ("TK", TK), ("W", W), ("CHUNK", chunk),
                                     ("HAS_MASK", has_mask), ("FINAL", final)],
            grid=(-(-rows // W) * W * 32, chunks, B * k.shape[1]), threadgroup=(W * 32, 1, 1), **outputs)
    if final:
        return out.transpose(0, 2, 1, 3)
    per_block = 4
    return _combine_kernel()(
        inputs=[part_m, part_l, part_o],
        template=[("OutT", q.dtype), ("D", D)],
        grid=(-(-n // per_block) * per_block * 32, 1, 1),
        threadgroup=(per_block * 32, 1, 1),
        output_shapes=[(B, L, Hq, D)],
        output_dtypes=[q.dtype],
    )[0].transpose(0, 2, 1, 3)
