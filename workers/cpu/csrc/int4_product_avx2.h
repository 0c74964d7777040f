// The AVX2 variant of int4_product.cpp's kernel, for CPUs without AVX-512 VNNI (any x86-64 of
// the last decade: AVX2, FMA and F16C). Same layouts, same arithmetic per output: bitwise the
// results of the VNNI variant.
#pragma once

#include <cstdint>

// Whether this CPU has AVX2, FMA and F16C (asked once).
bool int4_avx2_supported();

// Per row and group of 32 inputs: the int8 codes, the step and step * sum(codes), exactly as
// int4_product.cpp's quantize_rows computes them.
void quantize_rows_avx2(const float* x, int64_t rows, int64_t k, int8_t* q, float* steps, float* sums);

// Output tile `tile` (16 outputs) for rows [first_row, last_row).
void product_tile_rows_avx2(const int8_t* q, const float* steps, const float* sums, const uint8_t* codes,
                            const uint16_t* scales_and_minimums, float* y, int64_t k, int64_t n, int64_t tile,
                            int64_t first_row, int64_t last_row);
