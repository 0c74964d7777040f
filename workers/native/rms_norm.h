// The one-pass RMSNorm of rms_norm.cpp, for decode_stack.cpp.
#pragma once

#include <ATen/ATen.h>

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension of a float32 x.
at::Tensor rms_norm_one_pass(const at::Tensor& x, const at::Tensor& weight, double eps);
