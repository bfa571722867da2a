"""A residual add and the RMS norm after it as one CUDA kernel (mx.fast.cuda_kernel), for decode,
verify and draft forwards on MLX's CUDA backend (`KernelOptions.fused_norms`, norms.py).

A decoder layer adds its attention output to the residual stream and normalises the sum for the
MLP, and Gemma normalises the branch before it adds it. MLX runs each of those as a kernel of its
own, and a decode step or a verify of a small model pays for every launch (docs/performance.md,
"What a forward's time is made of"). Here one thread block per row does it all: the branch's norm
where asked, the add, the sum written out, its norm. On an H100 with CUDA graphs on that made no
end-to-end difference above the machine's noise, so it is off by default (norms.py).

The arithmetic is MLX's, rounding where MLX's separate kernels round: a norm's result is
`w * T(x * rsqrt(mean(x^2) + eps))` with the product rounded to T (MLX's `rms_norm` kernel), the
sum `T(h + r)`. Only the order of the float32 sum of squares may differ from MLX's kernel (ours:
each thread its elements in order, then a fixed tree), so a norm may differ from MLX's in its last
bits (up to 2 ulps in bf16); it is the same whatever rows share the call, which is what the lossless loop needs (a
decode step's one row and a verify's sixteen go through the same kernel).
"""

from __future__ import annotations

import functools

import mlx.core as mx

MAX_DIM = 8192  # a row's elements stay in registers: at most 32 per thread

# Products and sums rounded as written (float32 ones never contracted into a multiply-add, which
# would round once where MLX's separate kernels round twice); bf16 ones are rounded by their type.
_HEADER = """
template <typename U> __device__ __forceinline__ U mul_rn(U a, U b) { return a * b; }
template <> __device__ __forceinline__ float mul_rn<float>(float a, float b) { return __fmul_rn(a, b); }
template <typename U> __device__ __forceinline__ U add_rn(U a, U b) { return a + b; }
template <> __device__ __forceinline__ float add_rn<float>(float a, float b) { return __fadd_rn(a, b); }
"""

_SOURCE = """
    constexpr int EPT = (D + TPB - 1) / TPB;
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    __shared__ float partial[TPB / 32];
    __shared__ float total;

    // The block's sum of v[0..EPT) over its threads: each warp by shuffles, then the warps' sums
    // in order by the first thread. The same order for every row.
    auto block_sum = [&](const float (&v)[EPT]) {
      float acc = 0.0f;
      #pragma unroll
      for (int k = 0; k < EPT; ++k) acc += v[k] * v[k];
      #pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, offset);
      if ((tid & 31) == 0) partial[tid >> 5] = acc;
      __syncthreads();
      if (tid == 0) {
        float sum = 0.0f;
        #pragma unroll
        for (int w = 0; w < TPB / 32; ++w) sum += partial[w];
        total = sum;
      }
      __syncthreads();
      const float result = total;
      __syncthreads();
      return result;
    };

    const size_t base = (size_t)row * D;
    float x[EPT];
    #pragma unroll
    for (int k = 0; k < EPT; ++k) {
      const int i = tid + k * TPB;
      x[k] = i < D ? static_cast<float>(r[base + i]) : 0.0f;
    }
    if constexpr (BRANCH_NORM) {
      const float inv = rsqrtf(block_sum(x) / D + eps[1]);
      #pragma unroll
      for (int k = 0; k < EPT; ++k) {
        const int i = tid + k * TPB;
        if (i < D) x[k] = static_cast<float>(mul_rn<T>(branch_w[i], static_cast<T>(__fmul_rn(x[k], inv))));
      }
    }
    #pragma unroll
    for (int k = 0; k < EPT; ++k) {
      const int i = tid + k * TPB;
      if (i < D) {
        const T s = add_rn<T>(h[base + i], static_cast<T>(x[k]));
        sum_out[base + i] = s;
        x[k] = static_cast<float>(s);
      }
    }
"""
# The sum's norm, in the kernel that has the output for it.
_NORM = """
    const float inv = rsqrtf(block_sum(x) / D + eps[0]);
    #pragma unroll
    for (int k = 0; k < EPT; ++k) {
      const int i = tid + k * TPB;
      if (i < D) norm_out[base + i] = mul_rn<T>(w[i], static_cast<T>(__fmul_rn(x[k], inv)));
    }
"""


@functools.cache
def _kernel(norm: bool):
    outputs = ["sum_out", "norm_out"] if norm else ["sum_out"]
    return mx.fast.cuda_kernel(
        name="dflash_residual_norm" if norm else "dflash_residual_add",
        input_names=["h", "r", "w", "branch_w", "eps"],
        output_names=outputs,
        source=_SOURCE + _NORM if norm else _SOURCE,
        header=_HEADER,
    )


@functools.cache
def _epsilons(eps: float, branch_eps: float) -> mx.array:
    """The two eps as the kernel reads them: made once (a new array a call would be a copy to the
    device a call, where a forward is not compiled)."""
    eps = mx.array([eps, branch_eps], mx.float32)
    mx.eval(eps)
    return eps


def supported(h: mx.array, r: mx.array, *weights) -> bool:
    """bf16 or float32 rows of at most MAX_DIM, h and r alike, weights of the row's size and dtype."""
    D = h.shape[-1]
    return (h.dtype in (mx.bfloat16, mx.float32) and r.dtype == h.dtype and r.shape == h.shape and 0 < D <= MAX_DIM
            and all(w is None or (w.shape == (D,) and w.dtype == h.dtype) for w in weights))


def residual_norm(h: mx.array, r: mx.array, weight, eps: float, branch_weight=None, branch_eps: float = 0.0):
    """(s, n): s = h + r, or h + rms_norm(r, branch_weight, branch_eps) where a branch weight is given,
    and n = rms_norm(s, weight, eps), or only (s,) where `weight` is None (then a branch weight is)."""
    D = h.shape[-1]
    rows = h.size // D
    tpb = 128 if D <= 2048 else 256
    norm = weight is not None
    placeholder = weight if norm else branch_weight
    outs = _kernel(norm)(
        inputs=[h.reshape(rows, D), r.reshape(rows, D), placeholder,
                branch_weight if branch_weight is not None else placeholder,
                _epsilons(eps, branch_eps)],
        template=[("T", h.dtype), ("D", D), ("TPB", tpb), ("BRANCH_NORM", branch_weight is not None)],
        grid=(rows * tpb, 1, 1),
        threadgroup=(tpb, 1, 1),
        output_shapes=[(rows, D)] * (2 if norm else 1),
        output_dtypes=[h.dtype] * (2 if norm else 1),
    )
    return tuple(o.reshape(h.shape) for o in outs)
