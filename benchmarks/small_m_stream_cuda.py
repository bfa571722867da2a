"""An experiment that became the engine's bf16 kernel: `x @ w.T` for a few rows of x (M <= 32) on
tensor cores, built to keep enough weight bytes in flight to stream them at the card's bandwidth.
Measured by gpu_small_m.py. The kernel now lives in dflash_core/kernels/bf16_matmul_cuda.py, whose
docstring says how it streams; this file keeps its names for the benchmarks and the measuring
aids (a read probe, ncu markers).

Why it was written: small_m_matmul_cuda.py's kernels stayed at 1.3-2.5 TB/s, and Little's law
says why they may: at ~4 TB/s and ~1 us of loaded DRAM latency the card needs ~4 MB of loads in
flight, ~30 KB per SM. Their grid is one 2-warp block per 16 weight rows, so a 4096-row weight has
512 warps for 132 SMs (4 per SM) with 4 KB each in flight, and each warp waits for its loads
before it issues the next ones.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from dflash_core.kernels.bf16_matmul_cuda import (  # noqa: F401  (the kernel, moved into the engine's kernels)
    _HEADER,
    TARGET_WARPS,
    matmul_stream,
    max_warps,
    supported,
    warps_for,
)

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
