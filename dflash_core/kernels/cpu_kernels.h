// What this project's CPU primitives share (cpu_linear.cpp, cpu_softmax.cpp, cpu_attention.cpp; one
// extension module,
// cpu_module.cpp): a fixed-order sum of a vector's lanes and a split of rows among threads.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <future>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/mlx.h"
#include "mlx/threadpool.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace dflash {

// The eight lanes' sum, always in this order.
inline float lanes_sum(__m256 a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, a);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// lanes_sum of eight vectors at once, lane i of the result for a[i]: the same additions in the
// same order (pairs, then pairs of pairs, then the two halves), so the same bits.
inline __m256 lanes_sums8(const __m256* a) {
  const __m256 pairs01 = _mm256_hadd_ps(a[0], a[1]), pairs23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 pairs45 = _mm256_hadd_ps(a[4], a[5]), pairs67 = _mm256_hadd_ps(a[6], a[7]);
  // lanes: [a0 (0+1)+(2+3), a1 .., a2 .., a3 .. | the same of lanes 4-7]
  const __m256 quads0123 = _mm256_hadd_ps(pairs01, pairs23), quads4567 = _mm256_hadd_ps(pairs45, pairs67);
  const __m256 low = _mm256_permute2f128_ps(quads0123, quads4567, 0x20);
  const __m256 high = _mm256_permute2f128_ps(quads0123, quads4567, 0x31);
  return _mm256_add_ps(low, high);
}

struct Pool {
  int threads;
  ThreadPool pool;
  explicit Pool(int n) : threads(n), pool(std::max(1, n - 1)) {}
};

// One pool for the process (an inline function's static is one object across the module's files).
inline Pool& pool(int threads) {
  static Pool p(threads);
  return p;
}

// rows(r0, r1) over [0, N), split among up to `threads` threads (this one and the pool's), each
// with at least `min_rows`. A row is always computed whole by one thread.
template <class Rows>
void split_rows(int64_t N, int threads, int64_t min_rows, Rows rows) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, N / std::max<int64_t>(1, min_rows)));
  if (parts == 1) {
    rows(0, N);
    return;
  }
  Pool& p = pool(threads);
  std::vector<std::future<void>> done;
  for (int64_t i = 1; i < parts; i++) {
    const int64_t r0 = N * i / parts, r1 = N * (i + 1) / parts;
    done.push_back(p.pool.enqueue([=] { rows(r0, r1); }));
  }
  rows(0, N / parts);
  for (auto& f : done) f.get();
}

void add_linear(nb::module_& m);
void add_softmax(nb::module_& m);
void add_attention(nb::module_& m);

}  // namespace dflash
