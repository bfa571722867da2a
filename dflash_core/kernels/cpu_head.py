"""The LM head on the CPU with int8 or float16 weights, at the memory's bandwidth.

A decode step of a small model on a CPU is mostly its LM head: the demo's Gemma 3 270M spent 38 of
its 68 ms there (262144 x 640, float32, 671 MB a token). MLX's CPU backend multiplies float32 through
the BLAS it loads (MKL reaches about 18 GB/s on this project's 2 cores) and has no fast path for
narrower weights: float16, bfloat16 and its quantized matmul are 4-40x slower than float32 there
(`benchmarks/cpu_matmul.py`). So this keeps a narrow copy of a float32 head and multiplies it in a
small C kernel (AVX2, FMA, F16C), compiled on first use by the machine's C compiler into the cache and
run on every core through threads (ctypes releases the GIL). The copy is int8 blocks of 32 with a
float32 scale each where the float32 weights are exactly that (`int8_blocks`: a GGUF's Q8_0
embedding converted to float32, as the demo's is; the same weights in a quarter of the bytes, 5x
MLX's float32 product for one row), else float16 (the weights rounded, products and sums in float32:
half the bytes, 3.4x).

The copy takes host memory besides the float32 head, outside MLX's count (the demo's int8 head:
189 MB). Each logit is one sum over its row in a fixed order, whatever the other rows of the call,
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

/* The same for int8 weights in blocks of 32 along K with a float32 scale each (q [N, K], scales
   [N, K / 32], K a multiple of 32): y[m, r] = sum over blocks b of scale[r, b] * sum_{k in b} q x.
   A block's four chunks of eight are converted once for up to four rows of x; every (m, r) sums in
   the same order (a block's products into one vector, scaled into the row's vector, then the lanes
   pairwise), whatever M and the tile. */
void q8_head(const int8_t *q, const float *scales, const float *x, float *y, int64_t M, int64_t K, int64_t N,
             int64_t r0, int64_t r1) {
  const int64_t blocks = K / 32;
  for (int64_t r = r0; r < r1; r++) {
    const int8_t *qr = q + r * K;
    const float *sr = scales + r * blocks;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      int64_t mt = M - m0 < 4 ? M - m0 : 4;
      __m256 acc[4];
      for (int t = 0; t < 4; t++) acc[t] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; b++) {
        const int8_t *qb = qr + b * 32;
        __m256 w[4];
        for (int c = 0; c < 4; c++)
          w[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8 * c))));
        const __m256 scale = _mm256_set1_ps(sr[b]);
        for (int t = 0; t < mt; t++) {
          const float *xm = x + (m0 + t) * K + b * 32;
          __m256 block = _mm256_mul_ps(w[0], _mm256_loadu_ps(xm));
          block = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), block);
          block = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), block);
          block = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), block);
          acc[t] = _mm256_fmadd_ps(block, scale, acc[t]);
        }
      }
      for (int t = 0; t < mt; t++) y[(m0 + t) * N + r] = lanes_sum(acc[t]);
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
    lib.q8_head.restype = None
    lib.q8_head.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5
    return lib


@functools.cache
def default_threads() -> int:
    """Threads a kernel of ours splits its rows among: every core this process may run on (a
    container's or `taskset`'s CPU set, not the host's count), at most 16. Asked once: every
    projection of every forward asks, and `os.cpu_count()` reads a file under /sys each time
    (8-12 us here; a decode step of Gemma 3 270M asks over a hundred times)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (macOS has no CPU sets)
        cores = os.cpu_count() or 1
    return max(1, min(cores, 16))


class HalfHead:
    """x [..., K] float32 -> logits [..., N] float32 through a float16 copy of `weight` [N, K]."""

    def __init__(self, weight: mx.array, lib: ctypes.CDLL, threads: Optional[int] = None):
        self._start(np.array(weight.astype(mx.float16)), lib, threads)

    def _start(self, weight: np.ndarray, lib: ctypes.CDLL, threads: Optional[int]) -> None:
        self.weight = np.ascontiguousarray(weight)
        self.lib = lib
        self.threads = threads or default_threads()
        self.pool = concurrent.futures.ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def _rows(self, r0: int, r1: int, rows: np.ndarray, out: np.ndarray) -> None:
        N, K = self.weight.shape
        self.lib.half_head(self.weight.ctypes.data, rows.ctypes.data, out.ctypes.data, rows.shape[0], K, N, r0, r1)

    def __call__(self, x: mx.array) -> mx.array:
        N, K = self.weight.shape
        rows = np.ascontiguousarray(np.array(x.reshape(-1, K).astype(mx.float32)))
        out = np.empty((rows.shape[0], N), dtype=np.float32)
        if self.pool is None:
            self._rows(0, N, rows, out)
        else:
            bounds = np.linspace(0, N, self.threads + 1).astype(int)
            list(self.pool.map(lambda b: self._rows(int(b[0]), int(b[1]), rows, out), zip(bounds[:-1], bounds[1:])))
        return mx.array(out).reshape(*x.shape[:-1], N)


class Int8Head(HalfHead):
    """A head whose float32 weights are exactly int8 numbers times a float32 scale per 32 along K
    (a GGUF's Q8_0 embedding, as the demo's is, converted to float32): the int8 numbers and the
    scales, a quarter of the float32 bytes, the same weights (`int8_blocks` finds them)."""

    def __init__(self, q: np.ndarray, scales: np.ndarray, lib: ctypes.CDLL, threads: Optional[int] = None):
        self.scales = np.ascontiguousarray(scales)
        self._start(q, lib, threads)

    def _rows(self, r0: int, r1: int, rows: np.ndarray, out: np.ndarray) -> None:
        N, K = self.weight.shape
        self.lib.q8_head(self.weight.ctypes.data, self.scales.ctypes.data, rows.ctypes.data, out.ctypes.data,
                         rows.shape[0], K, N, r0, r1)


# A block's scale is its largest magnitude over one of these: how GGUF's Q8_0 (127), Q5_0 (16) and
# Q4_0 (8) quantize a block of 32, so float32 weights converted from those are found exact.
BLOCK_DIVISORS = (127, 16, 8)
ROWS_PER_CHECK = 4096  # rows checked at once (temporaries of a few of their size)


ROWS_TO_SAMPLE = 64  # rows checked first: most float32 weights fail there, and cheaply


def _int8_scales(blocks: np.ndarray, divisors) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """For blocks [rows, K / 32, 32]: whether each is int8 numbers times a scale (its largest
    magnitude over one of `divisors`, tried in turn), that scale, and each divisor's count of blocks."""
    amax = np.abs(blocks).max(axis=2)
    found = amax == 0
    chosen = np.zeros_like(amax)
    hits = []
    for divisor in divisors:
        if found.all():
            hits.append(0)
            continue
        scale = amax / np.float32(divisor)
        safe = np.where(scale == 0, np.float32(1), scale)[..., None]
        numbers = np.rint(blocks / safe)
        exact = (np.abs(numbers).max(axis=2) <= 127) & (numbers * safe == blocks).all(axis=2)
        chosen = np.where(exact & ~found, scale, chosen)
        hits.append(int((exact & ~found).sum()))
        found |= exact
    return found, chosen, hits


def int8_blocks(weight: mx.array) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(q int8 [N, K], scales float32 [N, K / 32]) with q times its block's scale exactly `weight`
    (float32 [N, K]), blocks of 32 along K, or None where some block is not such a multiple."""
    N, K = weight.shape
    if K % 32 or weight.dtype != mx.float32:
        return None
    found, _, hits = _int8_scales(np.array(weight[:ROWS_TO_SAMPLE]).reshape(-1, K // 32, 32), BLOCK_DIVISORS)
    if not found.all():
        return None
    divisors = [d for _, d in sorted(zip(hits, BLOCK_DIVISORS), key=lambda pair: -pair[0])]  # the sample's best first
    q = np.empty((N, K), dtype=np.int8)
    scales = np.empty((N, K // 32), dtype=np.float32)
    for r0 in range(0, N, ROWS_PER_CHECK):
        blocks = np.array(weight[r0 : r0 + ROWS_PER_CHECK]).reshape(-1, K // 32, 32)
        found, chosen, _ = _int8_scales(blocks, divisors)
        if not found.all():
            return None
        safe = np.where(chosen == 0, np.float32(1), chosen)[..., None]
        q[r0 : r0 + len(blocks)] = np.rint(blocks / safe).astype(np.int8).reshape(-1, K)
        scales[r0 : r0 + len(blocks)] = chosen
    return q, scales


def affine_blocks(weight: mx.array) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(q int8 [N, K], scales, biases float32 [N, K / 32]) with q times its block's scale plus its
    bias exactly `weight` (float32 [N, K]; exactly as real numbers, checked in float64), blocks of 32
    along K, or None. A block's bias is its smallest weight and its scale the smallest gap between
    two of its weights (or a half, third or quarter of it): how a GGUF's Q4_K blocks (a scale and a
    minimum per 32, numbers 0..15) come out converted to float32."""
    N, K = weight.shape
    if K % 32 or weight.dtype != mx.float32:
        return None
    if N > ROWS_TO_SAMPLE and affine_blocks(weight[:ROWS_TO_SAMPLE]) is None:
        return None
    q = np.empty((N, K), dtype=np.int8)
    scales = np.empty((N, K // 32), dtype=np.float32)
    biases = np.empty((N, K // 32), dtype=np.float32)
    for r0 in range(0, N, ROWS_PER_CHECK):
        blocks = np.array(weight[r0 : r0 + ROWS_PER_CHECK]).astype(np.float64).reshape(-1, K // 32, 32)
        low = blocks.min(axis=2, keepdims=True)
        found = np.zeros(low.shape[:2], dtype=bool)
        chosen = np.zeros_like(low)

        def attempt(scale):
            nonlocal found, chosen
            scale = np.where(scale > 0, scale, 1.0).astype(np.float32).astype(np.float64)
            numbers = np.rint((blocks - low) / scale)
            exact = (numbers.max(axis=2) <= 127) & (numbers * scale + low == blocks).all(axis=2)
            chosen = np.where((exact & ~found)[..., None], scale, chosen)
            found |= exact

        attempt((blocks.max(axis=2, keepdims=True) - low) / 15)  # Q4_K's usual block: numbers 0..15
        if not found.all():
            gaps = np.diff(np.sort(blocks, axis=2), axis=2)
            gaps[gaps == 0] = np.inf
            gap = gaps.min(axis=2, keepdims=True)
            for parts in (1, 2, 3, 4):
                attempt(np.where(np.isinf(gap), 1.0, gap / parts))
                if found.all():
                    break
        if not found.all():
            return None
        q[r0 : r0 + len(blocks)] = np.rint((blocks - low) / chosen).astype(np.int8).reshape(-1, K)
        scales[r0 : r0 + len(blocks)] = chosen[..., 0]
        biases[r0 : r0 + len(blocks)] = low[..., 0]
    return q, scales, biases


def half_head_for(weight: mx.array, min_parameters: int = MIN_PARAMETERS) -> Optional[HalfHead]:
    """The head in our kernel for this head's weight where it applies here (int8 where the weights
    are exactly int8 blocks, else float16), else None (MLX's head)."""
    if backend() != "cpu" or weight.dtype != mx.float32 or weight.ndim != 2 or weight.size < min_parameters:
        return None
    lib = library()
    if lib is None:
        return None
    blocks = int8_blocks(weight)
    return Int8Head(*blocks, lib) if blocks is not None else HalfHead(weight, lib)


def active_path() -> str:
    """Which LM head large float32 heads use here (for `dflash doctor`)."""
    if backend() != "cpu":
        return "not used (MLX runs on a GPU)"
    if not cpu_supports():
        return "MLX's float32 product (the kernel needs x86-64 Linux with AVX2, FMA and F16C)"
    lib = library()
    if lib is None:
        return "MLX's float32 product (the kernel did not compile: is there a C compiler, `cc`?)"
    return (f"int8 (where the float32 weights are exactly int8 blocks) or float16 weights in our kernel ({lib._name}) "
            f"for heads of {MIN_PARAMETERS // 2**20}M+ parameters")
