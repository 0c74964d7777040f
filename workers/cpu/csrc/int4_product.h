// The 4-bit product of int4_product.cpp (AVX-512 VNNI or AVX2), for decode_stack.cpp.
#pragma once

#include <ATen/ATen.h>

bool int4_product_supported();

// x [rows, inputs] float32 -> [rows, outputs] float32 (layouts in int4_product.cpp).
at::Tensor int4_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_and_minimums);
