// Softmax over the last axis of float32 scores on MLX's CPU backend, as an MLX primitive: the
// softmax of decode, verify and draft attention (kernels/attention.py). MLX's CPU `exp` costs about
// 20 ns a value on this project's machines (a multiply 0.4), so a verify's attention over a long
// cache was mostly its exps; here exp is a vectorized polynomial (AVX2, FMA).
//
// Row-invariant, and blind to masked scores wherever they sit: a row's result depends on its own
// values only, a masked score (MLX's lowest float, or anything more than 87 below the row's maximum)
// has an exp of exactly zero, and the exps are summed one after another in the row's order, so
// zeros anywhere (a cache's masked tail, the padding between a batched row's context and its block)
// add nothing. So a query's probabilities are the same bits whether it attends alone over the keys
// it has (decode) or in a block over a longer, masked buffer (verify, batched rows). A sum over
// vector lanes would be faster but would change with the positions of the zeros.

#include <cmath>
#include <limits>

#include "cpu_kernels.h"

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace dflash {

namespace {

// exp(x) for x <= 0 (a score minus its row's maximum): Cephes' single-precision exp (range
// reduction by ln 2 in two parts, a degree-5 polynomial, 2^n into the exponent), about 1 ulp.
// Below -87.3 (where the result would no longer be a normal float) it is exactly 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.33654f);
  const __m256 vanishes = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(vanishes, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

// Lanes [0, count) of a vector of 8 (count 1..8).
inline __m256i first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

void softmax_rows(const float* x, float* y, int64_t n, int64_t r0, int64_t r1) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t full = n - n % 8;
  const __m256i tail = first_lanes(n - full);
  for (int64_t r = r0; r < r1; r++) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    // The tail's missing lanes read as -inf: no effect on the maximum, an exp of exactly 0.
    const __m256 last = full < n ? _mm256_blendv_ps(minus_inf, _mm256_maskload_ps(xr + full, tail),
                                                    _mm256_castsi256_ps(tail))
                                 : minus_inf;
    __m256 top = last;
    __m256 nan = _mm256_cmp_ps(last, last, _CMP_UNORD_Q);
    for (int64_t j = 0; j < full; j += 8) {
      const __m256 v = _mm256_loadu_ps(xr + j);
      top = _mm256_max_ps(top, v);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float peak = *std::max_element(lanes, lanes + 8);
    if (_mm256_movemask_ps(nan) || peak == -std::numeric_limits<float>::infinity()) {
      // A NaN score, or no score above -inf: NaN throughout, as MLX's softmax gives.
      std::fill(yr, yr + n, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    const __m256 shift = _mm256_set1_ps(peak);
    for (int64_t j = 0; j < full; j += 8) _mm256_storeu_ps(yr + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(xr + j), shift)));
    if (full < n) _mm256_maskstore_ps(yr + full, tail, exp_nonpositive(_mm256_sub_ps(last, shift)));
    double sum = 0.0;  // in order (see the top of the file); in double, for rows of many keys
    for (int64_t j = 0; j < n; j++) sum += yr[j];
    const __m256 inverse = _mm256_set1_ps(static_cast<float>(1.0 / sum));
    for (int64_t j = 0; j < full; j += 8) _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_loadu_ps(yr + j), inverse));
    if (full < n) _mm256_maskstore_ps(yr + full, tail, _mm256_mul_ps(_mm256_maskload_ps(yr + full, tail), inverse));
  }
}

// Values per thread below which another thread costs more than it saves.
constexpr int64_t MIN_VALUES_PER_THREAD = 1 << 15;

class FastSoftmax : public Primitive {
 public:
  FastSoftmax(Stream stream, int threads) : Primitive(stream), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    const array& x = inputs[0];
    array& out = outputs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    const int64_t n = x.shape(-1), rows = n ? x.size() / n : 0;
    encoder.dispatch([=, xp = x.data<float>(), yp = out.data<float>(), threads = threads_]() {
      split_rows(rows, threads, MIN_VALUES_PER_THREAD / std::max<int64_t>(n, 1),
                 [=](int64_t r0, int64_t r1) { softmax_rows(xp, yp, n, r0, r1); });
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[dflash_cpu_kernels] runs on the CPU only");
  }

  // d softmax: y * (g - sum(g * y)) along the row (`dflash train` sends drafter blocks through it).
  std::vector<array> vjp(const std::vector<array>&, const std::vector<array>& cotangents,
                         const std::vector<int>&, const std::vector<array>& outputs) override {
    const array& y = outputs[0];
    const array& g = cotangents[0];
    return {multiply(y, subtract(g, sum(multiply(g, y, stream()), -1, true, stream()), stream()), stream())};
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

  const char* name() const override { return "DflashFastSoftmax"; }

  bool is_equivalent(const Primitive& other) const override {
    return threads_ == static_cast<const FastSoftmax&>(other).threads_;
  }

 private:
  int threads_;
};

array softmax(const array& x, int threads) {
  if (x.dtype() != float32 || x.ndim() < 1) {
    throw std::invalid_argument("[dflash_cpu_kernels] float32 scores [..., n] expected");
  }
  auto s = default_stream(Device::cpu);
  return array(x.shape(), float32, std::make_shared<FastSoftmax>(s, threads), {contiguous(x, false, s)});
}

}  // namespace

void add_softmax(nb::module_& m) {
  m.def("softmax", &softmax, nb::arg("x"), nb::arg("threads"),
        "softmax over the last axis of float32 x, row-invariant and exact zeros for masked scores, on the CPU.");
}

}  // namespace dflash
