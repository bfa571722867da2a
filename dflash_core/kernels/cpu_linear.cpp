// `x @ w.T` on MLX's CPU backend for float32 rows x [M, K] and narrow weights w [N, K], as MLX
// primitives: they sit inside MLX's graphs (compiled blocks included) like any op, so a decode step
// multiplies its weights at a half or a quarter of float32's bytes without leaving the graph
// (cpu_linear.py). Weights: float32 (`float_linear`: a small layer's own weights, for the fixed
// order alone), float16 (`half_linear`), or int8 in blocks of 32 along K with a float32
// scale each (`int8_linear`) and a float32 bias each (`affine_linear`), for weights that are exactly
// that.
//
// Row-invariant: every output (m, n) is one sum over k in a fixed order, whatever M and however the
// weight rows are split among threads, so a token's result is the same alone (decode) or beside 15
// others (verify).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace dflash {

namespace {

// Eight weights as float32: from float16 (converted) or float32.
inline __m256 load8(const uint16_t* w) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))); }
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline float load1(const uint16_t* w) { return _cvtsh_ss(*w); }
inline float load1(const float* w) { return *w; }

// y[m, r] for r in [r0, r1): a weight chunk is loaded (converted) once and used for up to four
// rows of x.
template <class W>
void dense_rows(const W* w, const float* x, float* y, int64_t M, int64_t K, int64_t N, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; r++) {
    const W* wr = w + r * K;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t mt = std::min<int64_t>(M - m0, 4);
      __m256 a0[4], a1[4];
      for (int t = 0; t < 4; t++) {
        a0[t] = _mm256_setzero_ps();
        a1[t] = _mm256_setzero_ps();
      }
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m256 w0 = load8(wr + k);
        const __m256 w1 = load8(wr + k + 8);
        for (int t = 0; t < mt; t++) {
          const float* xm = x + (m0 + t) * K + k;
          a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), a0[t]);
          a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), a1[t]);
        }
      }
      for (int t = 0; t < mt; t++) {
        const float* xm = x + (m0 + t) * K;
        float s = lanes_sum(_mm256_add_ps(a0[t], a1[t]));
        for (int64_t j = k; j < K; j++) s += load1(wr + j) * xm[j];
        y[(m0 + t) * N + r] = s;
      }
    }
  }
}

// y[m, r] for r in [r0, r1), int8 weights q [N, K] and scales [N, K / 32]: a block's 32 products
// into one vector, scaled into the row's vector, then the lanes pairwise. A block's four chunks of
// eight are converted once for up to four rows of x. With `biases` [N, K / 32] (a weight is
// scale * q + bias), each block adds bias * (its x's sum, `xsums` [M, K / 32]) to a scalar sum
// kept in block order, added to the lanes' sum at the end.
void int8_rows(const int8_t* q, const float* scales, const float* biases, const float* xsums, const float* x,
               float* y, int64_t M, int64_t K, int64_t N, int64_t r0, int64_t r1) {
  const int64_t blocks = K / 32;
  for (int64_t r = r0; r < r1; r++) {
    const int8_t* qr = q + r * K;
    const float* sr = scales + r * blocks;
    const float* br = biases ? biases + r * blocks : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t mt = std::min<int64_t>(M - m0, 4);
      __m256 acc[4];
      float offset[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int t = 0; t < 4; t++) acc[t] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; b++) {
        const int8_t* qb = qr + b * 32;
        __m256 w[4];
        for (int c = 0; c < 4; c++) {
          w[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * c))));
        }
        const __m256 scale = _mm256_set1_ps(sr[b]);
        for (int t = 0; t < mt; t++) {
          const float* xm = x + (m0 + t) * K + b * 32;
          __m256 block = _mm256_mul_ps(w[0], _mm256_loadu_ps(xm));
          block = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), block);
          block = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), block);
          block = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), block);
          acc[t] = _mm256_fmadd_ps(block, scale, acc[t]);
          if (br) offset[t] += br[b] * xsums[(m0 + t) * blocks + b];
        }
      }
      for (int t = 0; t < mt; t++) y[(m0 + t) * N + r] = lanes_sum(acc[t]) + offset[t];
    }
  }
}

// Weight rows per thread below which another thread costs more than it saves.
constexpr int64_t MIN_ROWS_PER_THREAD = 128;

// Each row's sums of x over blocks of 32, in a fixed order: xsums [M, K / 32].
void block_sums(const float* x, float* xsums, int64_t M, int64_t K) {
  const int64_t blocks = K / 32;
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < blocks; b++) {
      const float* xb = x + m * K + b * 32;
      __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
      xsums[m * blocks + b] = lanes_sum(s);
    }
  }
}

// inputs: x float32 [..., K], then the weight: w float16 [N, K]; or q int8 [N, K] and scales [N, K / 32],
// and biases [N, K / 32] for affine blocks.
class NarrowLinear : public Primitive {
 public:
  NarrowLinear(Stream stream, int threads) : Primitive(stream), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    const array& x = inputs[0];
    const array& w = inputs[1];
    array& out = outputs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    for (const array& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int64_t K = w.shape(1), N = w.shape(0), M = x.size() / K;
    const float* xp = x.data<float>();
    float* yp = out.data<float>();
    if (inputs.size() == 2 && w.dtype() == float32) {
      encoder.dispatch([=, wp = w.data<float>(), threads = threads_]() {
        split_rows(N, threads, MIN_ROWS_PER_THREAD, [=](int64_t r0, int64_t r1) { dense_rows(wp, xp, yp, M, K, N, r0, r1); });
      });
    } else if (inputs.size() == 2) {
      encoder.dispatch([=, wp = w.data<uint16_t>(), threads = threads_]() {
        split_rows(N, threads, MIN_ROWS_PER_THREAD, [=](int64_t r0, int64_t r1) { dense_rows(wp, xp, yp, M, K, N, r0, r1); });
      });
    } else if (inputs.size() == 3) {
      encoder.dispatch([=, qp = w.data<int8_t>(), sp = inputs[2].data<float>(), threads = threads_]() {
        split_rows(N, threads, MIN_ROWS_PER_THREAD, [=](int64_t r0, int64_t r1) { int8_rows(qp, sp, nullptr, nullptr, xp, yp, M, K, N, r0, r1); });
      });
    } else {
      encoder.dispatch([=, qp = w.data<int8_t>(), sp = inputs[2].data<float>(), bp = inputs[3].data<float>(),
                        threads = threads_]() {
        std::vector<float> xsums(M * (K / 32));
        block_sums(xp, xsums.data(), M, K);
        const float* xs = xsums.data();
        split_rows(N, threads, MIN_ROWS_PER_THREAD, [=](int64_t r0, int64_t r1) { int8_rows(qp, sp, bp, xs, xp, yp, M, K, N, r0, r1); });
      });
    }
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[dflash_cpu_linear] runs on the CPU only");
  }

  // The weight as float32 (for the input's gradient).
  array wide_weight(const std::vector<array>& primals) {
    array w = astype(primals[1], float32, stream());
    if (primals.size() == 2) return w;
    const int64_t N = w.shape(0), K = w.shape(1);
    array blocks = multiply(reshape(w, {static_cast<int>(N), static_cast<int>(K / 32), 32}, stream()),
                            expand_dims(primals[2], -1, stream()), stream());
    if (primals.size() == 4) blocks = add(blocks, expand_dims(primals[3], -1, stream()), stream());
    return reshape(blocks, {static_cast<int>(N), static_cast<int>(K)}, stream());
  }

  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    // From MLX's own matmuls. The input's gradient; the weight's where it is a float32 weight
    // multiplied as itself (`fixed_order_weight`: a drafter's layers in `dflash train`, with MKL
    // loaded), dW = gᵀ x over every row. A narrow copy is no parameter: zeros.
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0) {
        grads.push_back(matmul(cotangents[0], wide_weight(primals), stream()));
      } else if (arg == 1 && primals.size() == 2 && primals[1].dtype() == float32) {
        const int N = primals[1].shape(0), K = primals[1].shape(1);
        array g = reshape(cotangents[0], {-1, N}, stream());
        array x = reshape(primals[0], {-1, K}, stream());
        grads.push_back(matmul(transpose(g, stream()), x, stream()));
      } else {
        grads.push_back(zeros_like(primals[arg], stream()));
      }
    }
    return grads;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

  const char* name() const override { return "DflashNarrowLinear"; }

  bool is_equivalent(const Primitive& other) const override {
    return threads_ == static_cast<const NarrowLinear&>(other).threads_;
  }

 private:
  int threads_;
};

array narrow_linear(const array& x, std::vector<array> weight, int threads) {
  Shape shape = x.shape();
  shape.back() = weight[0].shape(0);
  auto s = default_stream(Device::cpu);
  std::vector<array> inputs = {contiguous(x, false, s)};
  for (const array& a : weight) inputs.push_back(contiguous(a, false, s));
  return array(shape, float32, std::make_shared<NarrowLinear>(s, threads), std::move(inputs));
}

array half_linear(const array& x, const array& w, int threads) {
  if (x.dtype() != float32 || w.dtype() != float16 || w.ndim() != 2 || x.ndim() < 1 ||
      x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("[dflash_cpu_linear] x float32 [..., K] and w float16 [N, K] expected");
  }
  return narrow_linear(x, {w}, threads);
}

array float_linear(const array& x, const array& w, int threads) {
  if (x.dtype() != float32 || w.dtype() != float32 || w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("[dflash_cpu_linear] x float32 [..., K] and w float32 [N, K] expected");
  }
  return narrow_linear(x, {w}, threads);
}

void check_int8(const array& x, const array& q, const array& scales) {
  if (x.dtype() != float32 || q.dtype() != int8 || scales.dtype() != float32 || q.ndim() != 2 ||
      x.ndim() < 1 || x.shape(-1) != q.shape(1) || q.shape(1) % 32 || scales.ndim() != 2 ||
      scales.shape(0) != q.shape(0) || scales.shape(1) != q.shape(1) / 32) {
    throw std::invalid_argument(
        "[dflash_cpu_linear] x float32 [..., K], q int8 [N, K] and scales float32 [N, K / 32] expected");
  }
}

array int8_linear(const array& x, const array& q, const array& scales, int threads) {
  check_int8(x, q, scales);
  return narrow_linear(x, {q, scales}, threads);
}

array affine_linear(const array& x, const array& q, const array& scales, const array& biases, int threads) {
  if (biases.dtype() != float32 || biases.shape() != scales.shape()) {
    throw std::invalid_argument("[dflash_cpu_linear] biases float32 of the scales' shape expected");
  }
  check_int8(x, q, scales);
  return narrow_linear(x, {q, scales, biases}, threads);
}

}  // namespace

void add_linear(nb::module_& m) {
  m.def("half_linear", &half_linear, nb::arg("x"), nb::arg("w"), nb::arg("threads"),
        "x @ w.T for float32 x [..., K] and float16 w [N, K], row-invariant, on the CPU.");
  m.def("float_linear", &float_linear, nb::arg("x"), nb::arg("w"), nb::arg("threads"),
        "x @ w.T for float32 x [..., K] and w [N, K], row-invariant, on the CPU.");
  m.def("int8_linear", &int8_linear, nb::arg("x"), nb::arg("q"), nb::arg("scales"), nb::arg("threads"),
        "x @ (q * scales per 32 along K).T for float32 x, int8 q [N, K], float32 scales [N, K / 32].");
  m.def("affine_linear", &affine_linear, nb::arg("x"), nb::arg("q"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("threads"), "x @ (q * scales + biases, per 32 along K).T: int8_linear with a bias per block.");
}

}  // namespace dflash
