// The float32 product of float32_product.cpp, for decode_stack.cpp.
#pragma once

#include <ATen/ATen.h>

// Whether this CPU (AVX-512F) runs it.
bool float32_product_supported();

// x [rows, inputs] float32, weight in the tiled layout of float32_product.cpp -> [rows, outputs].
at::Tensor float32_product(const at::Tensor& x, const at::Tensor& weight);
