// Attention's two products on MLX's CPU backend, as MLX primitives: the scores q·kᵀ and the
// probabilities' weighted sum of the values p·v, for float32 (kernels/attention.py, `unfused_cpu`).
//
// MLX sends both to the BLAS. The reference BLAS rounds a row the same whatever the other rows, but
// a fast one (MKL, which `dflash serve` loads on Linux) picks its kernels and its order of summation
// by the matrices' shapes: a 16-query verify then gave a token logits up to 5e-5 away from its
// one-query decode step, so a near-tie could turn a token. Here every output is one sum in a fixed
// order whatever the rows, keys or threads of the call:
// - a score is the query's and the key's products over the head dimension, in vector lanes in order,
//   then the lanes in a fixed order (cpu_kernels.h: lanes_sums8);
// - an output is the values' sum over the keys one after another (each key's value vector scaled by
//   its probability, vectorized across the value dimension). A masked key's probability is exactly
//   zero (cpu_softmax.cpp), and adding 0 · v (v finite: a cache's unused or stale entries are) leaves
//   a sum as it was, so a cache's masked tail or the padding inside a batched row changes no bit: a
//   query gets the same bits alone over the
//   keys it has (decode) or in a block over a longer, masked buffer (verify).
//
// The inputs' leading dimensions (batch, KV head) may have any strides and the rows any row stride
// (a KV cache's keys are a view of its buffer), so the cache is never copied.

#include <vector>

#include "cpu_kernels.h"

#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace dflash {

namespace {

// Where group g (an index over the leading dimensions, all but the last two) starts in a.
int64_t group_start(const array& a, int64_t g) {
  const Shape leading(a.shape().begin(), a.shape().end() - 2);
  const Strides strides(a.strides().begin(), a.strides().end() - 2);
  return elem_to_loc(static_cast<int>(g), leading, strides);
}

std::vector<int64_t> group_starts(const array& a, int64_t groups) {
  std::vector<int64_t> starts(groups);
  for (int64_t g = 0; g < groups; g++) starts[g] = group_start(a, g);
  return starts;
}

// A matrix of rows: its first element and the distance between rows.
struct Rows {
  const float* at;
  int64_t stride;
  const float* row(int64_t i) const { return at + i * stride; }
};

// GCC keeps a tile's sums in registers only when the loops over them are unrolled before it
// scalarizes the arrays (else it stores every sum to the stack at every step, 2-3x slower): hence
// the pragmas.
#define UNROLL _Pragma("GCC unroll 8")
#define UNROLL16 _Pragma("GCC unroll 16")

// Scores of RT query rows against TT keys: y[i, t] = q_i · k_t. The sums sit in one array padded
// to a multiple of 8, so their lanes are summed eight at a time.
template <int RT, int TT>
inline void score_tile(Rows q, Rows k, float* y, int64_t y_stride, int64_t D) {
  constexpr int N = RT * TT, padded = (N + 7) / 8 * 8;
  __m256 acc[padded];
  UNROLL16 for (int n = 0; n < padded; n++) acc[n] = _mm256_setzero_ps();
  const int64_t full = D - D % 8;
  for (int64_t d = 0; d < full; d += 8) {
    __m256 kv[TT];
    UNROLL for (int t = 0; t < TT; t++) kv[t] = _mm256_loadu_ps(k.row(t) + d);
    UNROLL for (int i = 0; i < RT; i++) {
      const __m256 qv = _mm256_loadu_ps(q.row(i) + d);
      UNROLL for (int t = 0; t < TT; t++) acc[i * TT + t] = _mm256_fmadd_ps(qv, kv[t], acc[i * TT + t]);
    }
  }
  alignas(32) float sums[padded];
  UNROLL for (int n = 0; n < padded; n += 8) _mm256_store_ps(sums + n, lanes_sums8(acc + n));
  UNROLL for (int i = 0; i < RT; i++) {
    UNROLL for (int t = 0; t < TT; t++) {
      float s = sums[i * TT + t];
      for (int64_t d = full; d < D; d++) s += q.row(i)[d] * k.row(t)[d];
      y[i * y_stride + t] = s;
    }
  }
}

template <int RT>
void score_rows(Rows q, Rows k, float* y, int64_t T, int64_t D, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + 3 <= t1; t += 3) score_tile<RT, 3>(q, Rows{k.row(t), k.stride}, y + t, T, D);
  for (; t < t1; t++) score_tile<RT, 1>(q, Rows{k.row(t), k.stride}, y + t, T, D);
}

// y [R, T] (rows of T) for the keys [t0, t1): all R query rows, four at a time (a tile of 4 rows
// by 3 keys keeps 12 sums in registers).
void scores_range(Rows q, Rows k, float* y, int64_t R, int64_t T, int64_t D, int64_t t0, int64_t t1) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) score_rows<4>(Rows{q.row(r), q.stride}, k, y + r * T, T, D, t0, t1);
  for (; r < R; r++) score_rows<1>(Rows{q.row(r), q.stride}, k, y + r * T, T, D, t0, t1);
}

// y[i, c..c+16) += sum over the keys [j0, j1) in order of p[i, j] * v[j, c..c+16), for RT rows
// (y holds the sum over the keys before j0; a float stored and loaded again is the same float).
template <int RT>
inline void value_tile(Rows p, Rows v, float* y, int64_t y_stride, int64_t c, int64_t j0, int64_t j1) {
  __m256 lo[RT], hi[RT];
  if (j0) {
    UNROLL for (int i = 0; i < RT; i++) {
      lo[i] = _mm256_loadu_ps(y + i * y_stride + c);
      hi[i] = _mm256_loadu_ps(y + i * y_stride + c + 8);
    }
  } else {
    UNROLL for (int i = 0; i < RT; i++) lo[i] = hi[i] = _mm256_setzero_ps();
  }
  for (int64_t j = j0; j < j1; j++) {
    const __m256 v0 = _mm256_loadu_ps(v.row(j) + c), v1 = _mm256_loadu_ps(v.row(j) + c + 8);
    UNROLL for (int i = 0; i < RT; i++) {
      const __m256 w = _mm256_broadcast_ss(p.row(i) + j);
      lo[i] = _mm256_fmadd_ps(w, v0, lo[i]);
      hi[i] = _mm256_fmadd_ps(w, v1, hi[i]);
    }
  }
  UNROLL for (int i = 0; i < RT; i++) {
    _mm256_storeu_ps(y + i * y_stride + c, lo[i]);
    _mm256_storeu_ps(y + i * y_stride + c + 8, hi[i]);
  }
}

template <int RT>
void value_rows(Rows p, Rows v, float* y, int64_t Dv, int64_t c, int64_t j0, int64_t j1, int64_t rows) {
  int64_t r = 0;
  for (; r + RT <= rows; r += RT) value_tile<RT>(Rows{p.row(r), p.stride}, v, y + r * Dv, Dv, c, j0, j1);
  switch (rows - r) {  // the last rows, fewer than RT
    case 5: value_tile<5>(Rows{p.row(r), p.stride}, v, y + r * Dv, Dv, c, j0, j1); break;
    case 4: value_tile<4>(Rows{p.row(r), p.stride}, v, y + r * Dv, Dv, c, j0, j1); break;
    case 3: value_tile<3>(Rows{p.row(r), p.stride}, v, y + r * Dv, Dv, c, j0, j1); break;
    case 2: value_tile<2>(Rows{p.row(r), p.stride}, v, y + r * Dv, Dv, c, j0, j1); break;
    case 1: value_tile<1>(Rows{p.row(r), p.stride}, v, y + r * Dv, Dv, c, j0, j1); break;
  }
}

constexpr int64_t KEYS_PER_PASS = 64;
constexpr int64_t COLUMNS_PER_ITEM = 32;  // a values work item: a group's rows, 32 value columns

// y [R, Dv] for the columns [c0, c1) (at most COLUMNS_PER_ITEM): over the keys in passes of
// KEYS_PER_PASS, each pass's values [keys, columns] packed into a contiguous block first (the rows of
// v are far apart, and the same few cache sets would hold all of a pass), then tiles of 6 rows by 16
// columns (12 sums in registers) over it. Columns past the last multiple of 16 are summed one by one.
void values_range(Rows p, Rows v, float* y, int64_t R, int64_t T, int64_t Dv, int64_t c0, int64_t c1) {
  const int64_t width = c1 - c0, vector_width = width - width % 16;
  alignas(32) float block[KEYS_PER_PASS * COLUMNS_PER_ITEM];
  for (int64_t j0 = 0; j0 < T || j0 == 0; j0 += KEYS_PER_PASS) {
    const int64_t j1 = std::min(T, j0 + KEYS_PER_PASS);
    for (int64_t j = j0; j < j1; j++) std::copy(v.row(j) + c0, v.row(j) + c0 + vector_width, block + (j - j0) * vector_width);
    const Rows packed{block - j0 * vector_width, vector_width};  // its row j is key j's columns
    for (int64_t c = 0; c < vector_width; c += 16) value_rows<6>(p, packed, y + c0, Dv, c, j0, j1, R);
  }
  for (int64_t i = 0; i < R; i++) {
    for (int64_t c = c0 + vector_width; c < c1; c++) {
      float s = 0.0f;
      for (int64_t j = 0; j < T; j++) s = std::fma(p.row(i)[j], v.row(j)[c], s);
      y[i * Dv + c] = s;
    }
  }
}

// Multiply-adds per thread below which another thread costs more than it saves.
constexpr int64_t MIN_FMAS_PER_THREAD = 1 << 18;
constexpr int64_t KEYS_PER_ITEM = 48;  // a scores work item: a group's rows against 48 keys

// An input whose last dimension is not contiguous (not seen from the attention paths) is copied
// into a row-contiguous temporary first. `for_input` makes the temporary (or returns the input);
// `copy_into` fills it, inside the dispatched task, once the input's data is there.
struct DenseInput {
  array dense;  // what the products read
  bool copied;

  static DenseInput for_input(const array& a, cpu::CommandEncoder& encoder) {
    if (a.strides().back() == 1 || a.shape(-1) == 1) return {a, false};
    array dense(a.shape(), float32, nullptr, {});
    dense.set_data(allocator::malloc(dense.nbytes()));
    encoder.add_temporary(dense);
    return {dense, true};
  }
};

void copy_into(const float* src, const Shape& shape, const Strides& strides, float* dst, int64_t size) {
  for (int64_t i = 0; i < size; i++) dst[i] = src[elem_to_loc(static_cast<int>(i), shape, strides)];
}

// inputs: a [..., R, K] and b [..., N, K] (`scores`: q and k, out [..., R, N]) or b [..., K, N]
// (`values`: p and v, out [..., R, N]), the same leading dimensions.
class AttentionProduct : public Primitive {
 public:
  AttentionProduct(Stream stream, bool values, int threads) : Primitive(stream), values_(values), threads_(threads) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    array& out = outputs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    auto& encoder = cpu::get_command_encoder(stream());
    DenseInput da = DenseInput::for_input(inputs[0], encoder), db = DenseInput::for_input(inputs[1], encoder);
    const array& a = da.dense;
    const array& b = db.dense;
    encoder.set_input_array(inputs[0]);
    encoder.set_input_array(inputs[1]);
    encoder.set_output_array(out);
    const int64_t R = a.shape(-2), K = a.shape(-1), N = out.shape(-1);
    const int64_t groups = R && N ? out.size() / (R * N) : 0;
    if (groups == 0) return;
    const int64_t a_stride = a.strides()[a.ndim() - 2], b_stride = b.strides()[b.ndim() - 2];
    const float* ap = a.data<float>();
    const float* bp = b.data<float>();
    float* yp = out.data<float>();
    std::vector<int64_t> a_starts = group_starts(a, groups), b_starts = group_starts(b, groups);
    const bool values = values_;
    const int64_t per_group = values ? (N + COLUMNS_PER_ITEM - 1) / COLUMNS_PER_ITEM : (N + KEYS_PER_ITEM - 1) / KEYS_PER_ITEM;
    const int64_t fmas_per_item = R * K * std::min(N, values ? COLUMNS_PER_ITEM : KEYS_PER_ITEM);
    // An input to copy: its data, shape and strides, and the temporary (else null pointers).
    const float* a_src = da.copied ? inputs[0].data<float>() : nullptr;
    const float* b_src = db.copied ? inputs[1].data<float>() : nullptr;
    float* a_dst = da.copied ? da.dense.data<float>() : nullptr;
    float* b_dst = db.copied ? db.dense.data<float>() : nullptr;
    const int64_t a_size = a.size(), b_size = b.size();
    encoder.dispatch([=, a_starts = std::move(a_starts), b_starts = std::move(b_starts), threads = threads_,
                      a_shape = inputs[0].shape(), a_strides = inputs[0].strides(), b_shape = inputs[1].shape(),
                      b_strides = inputs[1].strides()]() {
      if (a_src) copy_into(a_src, a_shape, a_strides, a_dst, a_size);
      if (b_src) copy_into(b_src, b_shape, b_strides, b_dst, b_size);
      split_rows(groups * per_group, threads, MIN_FMAS_PER_THREAD / std::max<int64_t>(fmas_per_item, 1),
                 [&](int64_t i0, int64_t i1) {
                   for (int64_t i = i0; i < i1; i++) {
                     const int64_t g = i / per_group, part = i % per_group;
                     const Rows a_rows{ap + a_starts[g], a_stride}, b_rows{bp + b_starts[g], b_stride};
                     float* y = yp + g * R * N;
                     if (values) {
                       const int64_t c0 = part * COLUMNS_PER_ITEM, c1 = std::min(N, c0 + COLUMNS_PER_ITEM);
                       values_range(a_rows, b_rows, y, R, K, N, c0, c1);
                     } else {
                       const int64_t t0 = part * KEYS_PER_ITEM, t1 = std::min(N, t0 + KEYS_PER_ITEM);
                       scores_range(a_rows, b_rows, y, R, N, K, t0, t1);
                     }
                   }
                 });
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[dflash_cpu_kernels] runs on the CPU only");
  }

  // MLX's own products for the gradients (`dflash train` sends drafter blocks through here).
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    const array& a = primals[0];
    const array& b = primals[1];
    const array& g = cotangents[0];
    std::vector<array> grads;
    for (int arg : argnums) {
      if (values_) {  // y = p v: dp = g vᵀ, dv = pᵀ g
        grads.push_back(arg == 0 ? matmul(g, swapaxes(b, -1, -2, stream()), stream())
                                 : matmul(swapaxes(a, -1, -2, stream()), g, stream()));
      } else {  // y = q kᵀ: dq = g k, dk = gᵀ q
        grads.push_back(arg == 0 ? matmul(g, b, stream()) : matmul(swapaxes(g, -1, -2, stream()), a, stream()));
      }
    }
    return grads;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() = values_ ? inputs[1].shape(-1) : inputs[1].shape(-2);
    return {shape};
  }

  const char* name() const override { return values_ ? "DflashAttentionValues" : "DflashAttentionScores"; }

  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const AttentionProduct&>(other);
    return values_ == o.values_ && threads_ == o.threads_;
  }

 private:
  bool values_;
  int threads_;
};

array product(const array& a, const array& b, bool values, int threads) {
  const int inner = values ? -2 : -1;
  if (a.dtype() != float32 || b.dtype() != float32 || a.ndim() < 2 || a.ndim() != b.ndim() ||
      a.shape(-1) != b.shape(inner) ||
      !std::equal(a.shape().begin(), a.shape().end() - 2, b.shape().begin())) {
    throw std::invalid_argument(values ? "[dflash_cpu_kernels] p float32 [..., R, T] and v [..., T, D] expected"
                                       : "[dflash_cpu_kernels] q float32 [..., R, D] and k [..., T, D] expected");
  }
  Shape shape = a.shape();
  shape.back() = values ? b.shape(-1) : b.shape(-2);
  auto s = default_stream(Device::cpu);
  return array(shape, float32, std::make_shared<AttentionProduct>(s, values, threads), {a, b});
}

array scores(const array& q, const array& k, int threads) { return product(q, k, false, threads); }

array values(const array& p, const array& v, int threads) { return product(p, v, true, threads); }

}  // namespace

void add_attention(nb::module_& m) {
  m.def("attention_scores", &scores, nb::arg("q"), nb::arg("k"), nb::arg("threads"),
        "q @ k.T over the last two axes for float32 q [..., R, D] and k [..., T, D], each score one "
        "sum in a fixed order, on the CPU.");
  m.def("attention_values", &values, nb::arg("p"), nb::arg("v"), nb::arg("threads"),
        "p @ v over the last two axes for float32 p [..., R, T] and v [..., T, D], each output summed "
        "over the keys in order, on the CPU.");
}

}  // namespace dflash
