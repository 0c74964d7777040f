// RMSNorm in one pass over each row, for models whose 4-bit layers run the native kernel
// (workers/fused_rms_norm.py's NativeRMSNorm; workers/native_decode.py builds this file).
//
// ATen computes rms_norm as six small ops (pow, mean, add, rsqrt, mul, mul), ~11 us for one
// row of 576 here, 61 times a decoded token; this is one loop. Its sum of squares runs in
// another order than ATen's reduction, so it is not bitwise ATen's: exact mode keeps ATen's
// (bitwise transformers'), and this serves only where the products are approximate already.
// The lean forward, the C++ stack and the module all call it, so they agree bitwise.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "rms_norm.h"

at::Tensor rms_norm_one_pass(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_cpu() && weight.is_cpu(), "the native RMSNorm runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "float32 only");
  const int64_t hidden = weight.numel();
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == hidden, "x's last dimension must be the weight's");
  const at::Tensor input = x.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(input);
  const int64_t rows = hidden == 0 ? 0 : input.numel() / hidden;
  const float* in = input.data_ptr<float>();
  const float* scale = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = in + r * hidden;
    // Eight partial sums: lets the compiler vectorize a fixed, deterministic order.
    float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= hidden; i += 8)
      for (int j = 0; j < 8; ++j) partial[j] += row[i + j] * row[i + j];
    float sum = 0;
    for (int j = 0; j < 8; ++j) sum += partial[j];
    for (; i < hidden; ++i) sum += row[i] * row[i];
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + epsilon);
    float* dst = o + r * hidden;
    for (int64_t k = 0; k < hidden; ++k) dst[k] = scale[k] * (row[k] * inverse);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(antiphon_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm_one_pass);
}
