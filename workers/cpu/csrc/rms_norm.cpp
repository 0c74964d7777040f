// RMSNorm in one pass over each row, for float32 CPU models (workers/cpu/rms_norm.py decides
// where it serves; workers/cpu/native_library.py builds this file).
//
// transformers' formula, weight * (x * rsqrt(mean(x^2) + eps)), is six torch calls, or one
// (F.rms_norm) that is still several ATen kernels inside, each with its own dispatch and
// temporaries: ~10 us for one row of 576 here, 61 norms a token of the default model. This
// reads a row twice (the sum of squares, then the scaling), from L1.
//
// A row's sum of squares is four chains of fused multiply-adds over 16-lane chunks, chunk c
// on chain c % 4, in input order, the chains then added pairwise and the 16 lanes summed in a
// fixed tree: each row's result depends on its values only, not on the rows beside it or the
// split between threads. Not bitwise ATen's (another summation order: rounding-level
// differences); the module forward, the lean forward and the C++ stack all call this one, so a
// row gets the same numbers whichever serves its step.
//
// x86-64 with AVX-512F only (per-function target, so the library still loads elsewhere);
// elsewhere rms_norm_supported() is false.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "rms_norm.h"

#include "avx512_util.h"

#ifdef ANTIPHON_AVX512_UTIL
namespace {

using antiphon::kLanes;
using antiphon::lanes_left;

// Rows of fewer elements than this per thread stay on one thread: waking the other costs more.
constexpr int64_t kElementsPerThread = 32768;

__attribute__((target("avx512f"))) void normalize_row(const float* x, const float* weight, float* out, int64_t hidden,
                                                      float eps) {
  const float mean = antiphon::sum_of_products(x, x, hidden) / static_cast<float>(hidden);
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t c = 0; c < (hidden + kLanes - 1) / kLanes; ++c) {
    const __mmask16 mask = lanes_left(hidden - c * kLanes);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + c * kLanes);
    const __m512 w = _mm512_maskz_loadu_ps(mask, weight + c * kLanes);
    // weight * (x * scale), each product rounded as the formula's two multiplies.
    _mm512_mask_storeu_ps(out + c * kLanes, mask, _mm512_mul_ps(w, _mm512_mul_ps(v, scale)));
  }
}

}  // namespace
#endif

bool rms_norm_supported() {
#ifdef ANTIPHON_AVX512_UTIL
  return antiphon::avx512f_supported();
#else
  return false;
#endif
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(rms_norm_supported(), "this CPU lacks AVX-512F");
  TORCH_CHECK(x.is_cpu() && weight.is_cpu(), "the RMSNorm runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, hidden] float32");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.size(0) == x.size(1),
              "weight must be [hidden] float32, hidden being x's ", x.size(1));
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and not negative");
  const int64_t rows = x.size(0), hidden = x.size(1);
  // Rows may be strided (a picked row of a larger batch); their elements must be contiguous.
  const at::Tensor input = hidden <= 1 || x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({rows, hidden}, x.options());
  if (rows == 0 || hidden == 0) return out;
#ifdef ANTIPHON_AVX512_UTIL
  const float* in = input.data_ptr<float>();
  const float* w_data = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t row_stride = input.stride(0);
  const float epsilon = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, kElementsPerThread / hidden);
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) normalize_row(in + r * row_stride, w_data, o + r * hidden, hidden, epsilon);
  });
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(antiphon_cpu, m) {
  m.def("rms_norm_supported() -> bool", &rms_norm_supported);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
}
