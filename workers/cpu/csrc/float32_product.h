// The float32 product of float32_product.cpp, for decode_stack.cpp.
#pragma once

#include <ATen/ATen.h>

// Whether this CPU (AVX-512F) runs it.
bool float32_product_supported();

// Products of this many rows or more take oneDNN's blocking; below it each row's result is the
// same whatever its batch. (The op float32_rows_for_onednn gives it to Python.)
constexpr int64_t kFloat32RowsForOneDNN = 256;

// x [rows, inputs] float32, weight in the tiled layout of float32_product.cpp -> [rows, outputs].
at::Tensor float32_product(const at::Tensor& x, const at::Tensor& weight);

// oneDNN's linear (mkldnn::_linear_pointwise, no activation): x [rows, inputs], weight packed by
// oneDNN or plain [outputs, inputs].
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
