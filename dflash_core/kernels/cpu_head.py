"""The LM head on the CPU with float16 weights, at the memory's bandwidth.

A decode step of a small model on a CPU is mostly its LM head: the demo's Gemma 3 270M spends 38 of
its 68 ms there (262144 x 640, float32, 671 MB a token). MLX's CPU backend multiplies float32 through
the BLAS it loads (MKL reaches about 18 GB/s on this project's 2 cores) and has no fast path for
narrower weights: float16, bfloat16 and its quantized matmul are 4-40x slower than float32 there
(`benchmarks/cpu_matmul.py`). So this keeps a float16 copy of a float32 head and multiplies it in a
small C kernel (AVX2, FMA, F16C), compiled on first use by the machine's C compiler into the cache and
run on every core through threads (ctypes releases the GIL): half the bytes, at about 29 GB/s, 3.4x
MLX's float32 product for one row.

The logits are the model's with its head's weights rounded to float16 (the products and sums in
float32). The copy takes half the head's float32 bytes of host memory besides (the demo's: 335 MB),
outside MLX's count. Each logit is one sum over its row in a fixed order, whatever the other rows of the call,
so a 16-token verify and a 1-token step give a token the same logits to the bit: speculative output
stays exactly the target-alone output (tests/test_cpu_head.py). Where it cannot run (not the CPU
backend, not x86-64 Linux with AVX2, FMA and F16C, no C compiler, a head that is not float32, or one
below `MIN_PARAMETERS`), the head is MLX's own product (`KernelOptions.cpu_half_head` off: always).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from . import backend

log = logging.getLogger(__name__)

# Below this the head is not what a step costs (and the tests' tiny models keep MLX's exact head).
MIN_PARAMETERS = 16 * 1024 * 1024

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

/* y[m, r] = sum_k w[r, k] x[m, k] for r in [r0, r1): w float16 [N, K], x float32 [M, K], y float32
   [M, N]. A weight chunk is converted once and used for up to four rows of x; every (m, r) sums in
   the same order (two accumulators by chunk parity, then the eight lanes pairwise, then the tail),
   whatever M and the tile, so a row's result does not depend on the rows beside it. */
static inline float lanes_sum(__m256 a) {
  float l[8];
  _mm256_storeu_ps(l, a);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

void half_head(const uint16_t *w, const float *x, float *y, int64_t M, int64_t K, int64_t N,
               int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; r++) {
    const uint16_t *wr = w + r * K;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      int64_t mt = M - m0 < 4 ? M - m0 : 4;
      __m256 a0[4], a1[4];
      for (int t = 0; t < 4; t++) { a0[t] = _mm256_setzero_ps(); a1[t] = _mm256_setzero_ps(); }
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wr + k)));
        __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wr + k + 8)));
        for (int t = 0; t < mt; t++) {
          const float *xm = x + (m0 + t) * K + k;
          a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), a0[t]);
          a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), a1[t]);
        }
      }
      for (int t = 0; t < mt; t++) {
        const float *xm = x + (m0 + t) * K;
        float s = lanes_sum(_mm256_add_ps(a0[t], a1[t]));
        for (int64_t j = k; j < K; j++) s += _cvtsh_ss(wr[j]) * xm[j];
        y[(m0 + t) * N + r] = s;
      }
    }
  }
}
"""
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC"]


def cpu_supports() -> bool:
    """x86-64 Linux with the instructions the kernel uses."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return {"avx2", "fma", "f16c"} <= set(flags.split())


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    """The compiled kernel (compiled once per source into the cache), or None where it cannot be."""
    if not cpu_supports():
        return None
    from ..demo import cache_root

    digest = hashlib.sha256((SOURCE + " ".join(FLAGS)).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"cpu_head-{digest}.so"
    if not path.exists():
        compiler = os.environ.get("CC", "cc")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            source, built = Path(tmp) / "cpu_head.c", Path(tmp) / path.name
            source.write_text(SOURCE)
            try:
                subprocess.run([compiler, *FLAGS, "-o", str(built), str(source)], check=True, capture_output=True,
                               timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                log.info("the CPU LM head kernel did not compile (%s): MLX's float32 head instead", e)
                return None
            built.replace(path)  # atomic: a concurrent process sees the whole file or none
    lib = ctypes.CDLL(str(path))
    lib.half_head.restype = None
    lib.half_head.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
    return lib


class HalfHead:
    """x [..., K] float32 -> logits [..., N] float32 through a float16 copy of `weight` [N, K]."""

    def __init__(self, weight: mx.array, lib: ctypes.CDLL, threads: Optional[int] = None):
        self.weight = np.ascontiguousarray(np.array(weight.astype(mx.float16)))
        self.lib = lib
        self.threads = max(1, min(threads or os.cpu_count() or 1, 16))
        self.pool = concurrent.futures.ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def __call__(self, x: mx.array) -> mx.array:
        N, K = self.weight.shape
        rows = np.ascontiguousarray(np.array(x.reshape(-1, K).astype(mx.float32)))
        M = rows.shape[0]
        out = np.empty((M, N), dtype=np.float32)
        args = (self.weight.ctypes.data, rows.ctypes.data, out.ctypes.data, M, K, N)
        if self.pool is None:
            self.lib.half_head(*args, 0, N)
        else:
            bounds = np.linspace(0, N, self.threads + 1).astype(int)
            list(self.pool.map(lambda b: self.lib.half_head(*args, int(b[0]), int(b[1])), zip(bounds[:-1], bounds[1:])))
        return mx.array(out).reshape(*x.shape[:-1], N)


def half_head_for(weight: mx.array, min_parameters: int = MIN_PARAMETERS) -> Optional[HalfHead]:
    """A HalfHead for this head's weight where it applies here, else None (MLX's head)."""
    if backend() != "cpu" or weight.dtype != mx.float32 or weight.ndim != 2 or weight.size < min_parameters:
        return None
    lib = library()
    return HalfHead(weight, lib) if lib is not None else None


def active_path() -> str:
    """Which LM head large float32 heads use here (for `dflash doctor`)."""
    if backend() != "cpu":
        return "not used (MLX runs on a GPU)"
    if not cpu_supports():
        return "MLX's float32 product (the float16 kernel needs x86-64 Linux with AVX2, FMA and F16C)"
    lib = library()
    if lib is None:
        return "MLX's float32 product (the float16 kernel did not compile: is there a C compiler, `cc`?)"
    return f"float16 weights in our kernel ({lib._name}) for heads of {MIN_PARAMETERS // 2**20}M+ parameters"
