// The RMSNorm of rms_norm.cpp, for decode_stack.cpp.
#pragma once

#include <ATen/ATen.h>

// Whether this CPU (AVX-512F) runs it.
bool rms_norm_supported();

// x [rows, hidden] float32 (rows of any stride, elements contiguous), weight [hidden] float32
// -> weight * (x / sqrt(mean(x^2) + eps)), [rows, hidden].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
