// A float32 weight product for CPU serving in exact mode (workers/cpu/float32_linear.py holds
// the weights; workers/cpu/native_library.py builds this file).
//
// A one-row product reads its whole weight matrix to do two flops a weight, so its speed is
// the speed at which the weights stream from memory. oneDNN's packed float32 product streamed
// the default model's layers at ~15-20 GB/s for one row here. This kernel lays each matrix out
// as one sequential stream per tile of outputs and prefetches ahead in it: 1.4-2x oneDNN's for
// one row, with the host's bandwidth of the minute (benchmarks/float32_products.py).
//
// Layout (float32_linear.tile_weight), for N outputs and K inputs, multiples of 8 and 16:
//   float32 [N/8, K/16, 8, 16]: tile t, chunk c, output j, lane i holds the weight of output
//   8t + j for input 16c + i.
//
// Each output of each row is one chain of fused multiply-adds over its chunks, 16 lanes wide,
// in input order, then the 16 lanes summed in a fixed tree: the same arithmetic whatever the
// number of rows (below kRowsForOneDNN), the rows around it or the split between threads. So
// up to 255 rows a row's result does not depend on its batch (oneDNN's blocking does vary with
// the number of rows; a decode row in a step beside a long prefill chunk takes oneDNN), and it is
// float32 products summed in another order than F.linear's: rounding-level differences, as
// between any two GEMM kernels.
//
// Steps of kRowsForOneDNN rows or more (long prefill chunks) are arithmetic-bound, where
// oneDNN's blocking is 1.3x faster at 512 rows: they take oneDNN's product on a plain copy of
// the weights made for the call (a second copy kept beside the tiles would double exact mode's
// memory; the copy costs ~6% of such a step).
//
// x86-64 with AVX-512F only (per-function target, so the library still loads elsewhere);
// elsewhere float32_product_supported() is false.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>

#include "float32_product.h"

namespace {
constexpr int64_t kOutputs = 8;  // outputs per tile
constexpr int64_t kLanes = 16;   // inputs per chunk: one 512-bit register of floats
// Measured over the default model's layers (benchmarks/float32_products.py): at 128 rows this
// kernel and oneDNN on a copy are even, at 512 oneDNN is 1.28x faster.
constexpr int64_t kRowsForOneDNN = kFloat32RowsForOneDNN;
}  // namespace

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  static const c10::List<c10::optional<at::Scalar>> no_scalars;
  return op.call(x, weight, bias, "none", no_scalars, c10::nullopt);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ANTIPHON_FLOAT32_PRODUCT 1
#include <immintrin.h>

namespace {

#define AVX512_TARGET __attribute__((target("avx512f")))

// Rows per pass over a tile: 2 x 8 accumulators leave registers for the weights.
constexpr int64_t kRowsPerPass = 2;
// How far ahead in a tile's stream to prefetch: measured best of 512, 1024 and 2048 bytes (one
// row over the default model's layers: 17.2, 13.3 and 13.9 ms; the hardware prefetcher alone
// 22.5 ms with a plain row-major layout).
constexpr int64_t kPrefetchFloats = 1024 / sizeof(float);

// `Rows` (1 or 2) rows of x against one tile of weights: 8 outputs of each row.
template <int Rows>
AVX512_TARGET void product_pass(const float* x, int64_t k, const float* tile, float* y, int64_t n) {
  __m512 acc[Rows][kOutputs];
#pragma GCC unroll 2
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < kOutputs; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < k / kLanes; ++c) {
    const float* weights = tile + c * kOutputs * kLanes;
    // The chunk 1 KB ahead: 8 cache lines, one chunk's worth (past the last tile's end too:
    // a prefetch never faults).
#pragma GCC unroll 8
    for (int line = 0; line < kOutputs; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(weights + kPrefetchFloats + line * kLanes), _MM_HINT_T0);
    }
#pragma GCC unroll 2
    for (int r = 0; r < Rows; ++r) {
      const __m512 inputs = _mm512_loadu_ps(x + r * k + c * kLanes);
#pragma GCC unroll 8
      for (int j = 0; j < kOutputs; ++j) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(weights + j * kLanes), inputs, acc[r][j]);
      }
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < kOutputs; ++j) y[r * n + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}

AVX512_TARGET void product_tiles(const float* x, const float* weight, float* y, int64_t rows, int64_t k, int64_t n,
                                 int64_t first, int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    const float* tile = weight + t * kOutputs * k;
    float* out = y + t * kOutputs;
    int64_t row = 0;
    for (; row + kRowsPerPass <= rows; row += kRowsPerPass) product_pass<2>(x + row * k, k, tile, out + row * n, n);
    if (row < rows) product_pass<1>(x + row * k, k, tile, out + row * n, n);
  }
}

}  // namespace
#endif  // ANTIPHON_FLOAT32_PRODUCT

bool float32_product_supported() {
#ifdef ANTIPHON_FLOAT32_PRODUCT
  static const bool avx512 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return avx512;
#else
  return false;
#endif
}

at::Tensor float32_product(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(float32_product_supported(), "this CPU lacks AVX-512F");
  TORCH_CHECK(x.is_cpu() && weight.is_cpu(), "the float32 product runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, inputs] float32");
  TORCH_CHECK(weight.dim() == 4 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(2) == kOutputs && weight.size(3) == kLanes,
              "weight must be contiguous [outputs/8, inputs/16, 8, 16] float32");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0) * kOutputs;
  TORCH_CHECK(weight.size(1) * kLanes == k, "x has ", k, " inputs, the weights ", weight.size(1) * kLanes);
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty({rows, n}, input.options());
  if (rows == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  if (rows >= kRowsForOneDNN && at::hasMKLDNN()) {
    // [N/8, 8, K/16, 16] -> [N, K]: one copy per call (reshape cannot view it), of one matrix.
    return onednn_linear(input, weight.transpose(1, 2).reshape({n, k}), c10::nullopt);
  }
#ifdef ANTIPHON_FLOAT32_PRODUCT
  const float* x_data = input.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  float* out = y.data_ptr<float>();
  // A thread's share is at least ~64 KB of weights: smaller splits cost more than they save.
  const int64_t grain = std::max<int64_t>(1, 16384 / (kOutputs * k));
  at::parallel_for(0, weight.size(0), grain, [&](int64_t first, int64_t last) {
    product_tiles(x_data, w_data, out, rows, k, n, first, last);
  });
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(antiphon_cpu, m) {
  m.def("float32_product_supported() -> bool", &float32_product_supported);
  m.def("float32_product(Tensor x, Tensor weight) -> Tensor", &float32_product);
  // For the callers that compute some rows apart (workers/cpu/float32_linear.py).
  m.def("float32_rows_for_onednn() -> int", []() -> int64_t { return kFloat32RowsForOneDNN; });
}
