// A 4-bit weight product for CPU decode steps with AVX-512 VNNI integer dot products, or
// AVX2's where the CPU lacks VNNI (int4_product_avx2.cpp: bitwise the same results)
// (workers/cpu/int4.py describes the weights; workers/cpu/native_library.py builds this file).
//
// A decode step's products are memory-bound: the 4-bit codes are read once per step. This
// kernel does what llama.cpp does for Q4_1 weights: each row of the input is quantized to
// 8 bits per group of 32 (one float step per group, a "Q8" activation), and codes times those
// integers are summed exactly with vpdpbusd (64 multiply-adds per instruction); each group's
// integer sum is then scaled in float. That costs about a third of the arithmetic of
// converting every weight to bfloat16 as torch's own 4-bit kernel does, and keeps the weights'
// float16 scales and minimums exact (GGUF's Q4_1 stores them as float16; torch's kernel rounds
// them to bfloat16). Measured against that kernel over 210 layers of the default model's
// shapes, read from memory, two threads: 1.1-1.3x for one row, 1.6-1.9x for eight.
//
// x86-64 only (AVX-512 or AVX2 intrinsics, compiled for their target per function, so the
// library loads on any x86-64 CPU); elsewhere int4_product_supported() is false.
//
// Layout (int4.Int4Weight.native_layout), for N outputs and K inputs, in tiles of 16
// outputs and groups of 32 inputs:
//   codes  uint8 [N/16, K/32, 4, 64]: in pair p of a group, byte 4*j + i holds output j's
//          code for input 8p + i in its low nibble and for input 8p + 4 + i in its high one,
//          which is the operand order of vpdpbusd (four bytes per 32-bit lane, lane = output);
//   scales_and_minimums float16 [N/16, K/32, 2, 16]: each group's steps, then its minimums
//          (weight = code * step + minimum).
//
// Each output row's arithmetic is the same whatever the number of rows or the split between
// threads, so a row's result does not depend on its batch, and concatenated weights give
// bitwise the columns of separate calls.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "int4_product.h"
#include "int4_product_avx2.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define ANTIPHON_INT4_PRODUCT 1
#include <immintrin.h>
#endif

namespace {
constexpr int64_t kGroup = 32;  // inputs per group
constexpr int64_t kTile = 16;   // outputs per tile: one 512-bit register of int32 lanes
}  // namespace

#ifdef ANTIPHON_INT4_PRODUCT
namespace {

constexpr int64_t kMaxRowsPerPass = 4;

// The threads share a product's work in items of one tile of outputs and up to this many rows
// (a multiple of kMaxRowsPerPass, so the passes fall as in a whole-tile call: the same
// arithmetic per row). Up to this many rows that is one item per tile, as a decode step of a
// few streams needs; a step of many rows (decode steps take this kernel up to 512,
// row_layout.KernelRowLimits) also spreads over its rows, so on a many-core CPU the
// threads are not limited to a layer's tiles (36 for a 576-output layer, in items of 4).
constexpr int64_t kRowsPerItem = 16;
static_assert(kRowsPerItem % kMaxRowsPerPass == 0, "items hold whole passes");
// Inputs of more rows than this are quantized by the threads together.
constexpr int64_t kRowsToQuantizeApart = 16;

// Four int8 inputs read as one 32-bit value (any alignment, aliasing the int8 array).
typedef int32_t FourInputs __attribute__((may_alias, aligned(1)));

// The loops over rows, pairs and chains below are unrolled (#pragma GCC unroll) so that their
// arrays of vectors live in registers: at -O2 GCC kept them on the stack, with a store and a
// load around every vpdpbusd.

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")))

// Per row and group of 32 inputs: int8 codes q (x ~ q * step), the step, and the sum of the
// quantized inputs, step * sum(q), for the minimums' term. Not the plain sum of x: with it,
// the input's rounding error would multiply the codes' part of each weight alone (code *
// scale, 0..15 steps, never centred) instead of the whole weight (code * scale + minimum,
// about centred), which costs more: the default model's perplexity 27.76 against 26.94 (as
// llama.cpp's Q8_1 does, for the same reason).
VNNI_TARGET void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* steps, float* sums) {
  const int64_t groups = k / kGroup;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* in = x + r * k + g * kGroup;
      const __m512 a = _mm512_loadu_ps(in), b = _mm512_loadu_ps(in + 16);
      // A NaN anywhere in the group makes the step NaN, hence every output it reaches (max
      // instructions pass NaN on or drop it depending on the operand order, which differs
      // between this reduction and the AVX2 variant's).
      const bool unordered = (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) != 0;
      const float amax =
          unordered ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      // A group of zeros, or one so small that 127 / amax overflows, gets codes 0 (its share
      // of the output is below float32's resolution anyway).
      const float ratio = 127.0f / amax;
      const float inverse = amax > 0.0f && std::isfinite(ratio) ? ratio : 0.0f;
      const float step = amax / 127.0f;
      // Round to nearest, ties to even (explicitly, whatever the thread's rounding mode); the
      // codes lie in -127..127, so the int8 stores below never saturate.
      constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)), kNearest);
      const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)), kNearest);
      steps[r * groups + g] = step;
      sums[r * groups + g] = step * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
      int8_t* out = q + r * k + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qb));
    }
  }
}

// Output tile `tile` for ROWS rows starting at `row`.
template <int ROWS>
VNNI_TARGET void product_tile(const int8_t* q, const float* steps, const float* sums, const uint8_t* codes,
                              const uint16_t* scales_and_minimums, float* y, int64_t k, int64_t n, int64_t row,
                              int64_t tile) {
  // Independent accumulator chains per row: vpdpbusd's latency, not its throughput, would
  // bound a single chain.
  constexpr int kChains = ROWS >= 4 ? 1 : 4 / ROWS;
  const int64_t groups = k / kGroup;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 out[ROWS];
  #pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_setzero_ps();
  const uint8_t* tile_codes = codes + tile * groups * 4 * 64;
  const uint16_t* tile_scales = scales_and_minimums + tile * groups * 2 * kTile;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum[ROWS][kChains];
    #pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r)
      #pragma GCC unroll 16
      for (int c = 0; c < kChains; ++c) sum[r][c] = _mm512_setzero_si512();
    #pragma GCC unroll 16
    for (int p = 0; p < 4; ++p) {
      const __m512i packed = _mm512_loadu_si512(tile_codes + (g * 4 + p) * 64);
      const __m512i first = _mm512_and_si512(packed, low_nibbles);
      const __m512i second = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      #pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        // Four int8 inputs each, broadcast to every lane straight from memory (a load-port
        // broadcast; through a general register it costs a shuffle per vpdpbusd).
        const FourInputs* inputs = reinterpret_cast<const FourInputs*>(q + (row + r) * k + g * kGroup + p * 8);
        __m512i& chain = sum[r][p % kChains];
        chain = _mm512_dpbusd_epi32(chain, first, _mm512_set1_epi32(inputs[0]));
        chain = _mm512_dpbusd_epi32(chain, second, _mm512_set1_epi32(inputs[1]));
      }
    }
    const uint16_t* group_scales = tile_scales + g * 2 * kTile;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_scales)));
    const __m512 minimum =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_scales + kTile)));
    #pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      __m512i total = sum[r][0];
      #pragma GCC unroll 16
      for (int c = 1; c < kChains; ++c) total = _mm512_add_epi32(total, sum[r][c]);
      const int64_t at = (row + r) * groups + g;
      const __m512 weighted = _mm512_mul_ps(scale, _mm512_set1_ps(steps[at]));
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), weighted, out[r]);
      out[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[at]), out[r]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(y + (row + r) * n + tile * kTile, out[r]);
}

// Output tile `tile` for rows [first_row, last_row), first_row a multiple of kMaxRowsPerPass.
VNNI_TARGET void product_tile_rows(const int8_t* q, const float* steps, const float* sums, const uint8_t* codes,
                                   const uint16_t* scales_and_minimums, float* y, int64_t k, int64_t n,
                                   int64_t tile, int64_t first_row, int64_t last_row) {
  // Rows in passes of up to four: the tile's codes (K / 2 bytes) are re-read from cache, not
  // memory.
  for (int64_t row = first_row; row < last_row; row += kMaxRowsPerPass) {
    switch (std::min(last_row - row, kMaxRowsPerPass)) {
      case 1: product_tile<1>(q, steps, sums, codes, scales_and_minimums, y, k, n, row, tile); break;
      case 2: product_tile<2>(q, steps, sums, codes, scales_and_minimums, y, k, n, row, tile); break;
      case 3: product_tile<3>(q, steps, sums, codes, scales_and_minimums, y, k, n, row, tile); break;
      default: product_tile<4>(q, steps, sums, codes, scales_and_minimums, y, k, n, row, tile); break;
    }
  }
}

}  // namespace
#endif  // ANTIPHON_INT4_PRODUCT

namespace {

bool vnni_supported() {
#ifdef ANTIPHON_INT4_PRODUCT
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return supported;
#else
  return false;
#endif
}

// The product with the VNNI variant of the kernel, or the AVX2 one.
at::Tensor int4_product_with(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_and_minimums,
                             bool vnni) {
  TORCH_CHECK(vnni ? vnni_supported() : int4_avx2_supported(),
              vnni ? "this CPU lacks AVX-512 VNNI" : "this CPU lacks AVX2, FMA and F16C");
  TORCH_CHECK(x.is_cpu() && codes.is_cpu() && scales_and_minimums.is_cpu(), "the 4-bit product runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [rows, inputs] float32");
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(2) == 4 &&
                  codes.size(3) == 64,
              "codes must be contiguous [outputs/16, inputs/32, 4, 64] uint8");
  const int64_t tiles = codes.size(0), groups = codes.size(1), rows = x.size(0), k = groups * kGroup,
                n = tiles * kTile;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " inputs, the weights ", k);
  TORCH_CHECK(scales_and_minimums.scalar_type() == at::kHalf && scales_and_minimums.is_contiguous() &&
                  scales_and_minimums.sizes() == at::IntArrayRef({tiles, groups, 2, kTile}),
              "scales_and_minimums must be contiguous [outputs/16, inputs/32, 2, 16] float16");
  const at::Tensor input = x.contiguous();
  at::Tensor q = at::empty({rows, k}, input.options().dtype(at::kChar));
  at::Tensor steps = at::empty({rows, groups}, input.options());
  at::Tensor sums = at::empty({rows, groups}, input.options());
  at::Tensor y = at::empty({rows, n}, input.options());
  if (rows == 0) return y;
#ifdef ANTIPHON_INT4_PRODUCT
  const float* x_data = input.data_ptr<float>();
  int8_t* q_data = q.data_ptr<int8_t>();
  float* step_data = steps.data_ptr<float>();
  float* sum_data = sums.data_ptr<float>();
  // Each row on its own: the same codes whoever quantizes it.
  at::parallel_for(0, rows, kRowsToQuantizeApart, [&](int64_t first, int64_t last) {
    (vnni ? quantize_rows : quantize_rows_avx2)(x_data + first * k, last - first, k, q_data + first * k,
                                                step_data + first * groups, sum_data + first * groups);
  });
  const uint8_t* code_data = codes.data_ptr<uint8_t>();
  const uint16_t* scale_data = reinterpret_cast<const uint16_t*>(scales_and_minimums.data_ptr<at::Half>());
  float* out = y.data_ptr<float>();
  const int64_t row_blocks = (rows + kRowsPerItem - 1) / kRowsPerItem;
  const auto tile_rows = vnni ? product_tile_rows : product_tile_rows_avx2;
  // Items of one tile lie side by side, so consecutive items reuse its codes from cache.
  at::parallel_for(0, tiles * row_blocks, 4, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t tile = item / row_blocks, first_row = item % row_blocks * kRowsPerItem;
      tile_rows(q_data, step_data, sum_data, code_data, scale_data, out, k, n, tile, first_row,
                std::min(rows, first_row + kRowsPerItem));
    }
  });
#endif
  return y;
}

}  // namespace

bool int4_product_supported() { return vnni_supported() || int4_avx2_supported(); }

std::string int4_product_isa() {
  return vnni_supported() ? "avx512_vnni" : int4_avx2_supported() ? "avx2" : "none";
}

at::Tensor int4_product(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_and_minimums) {
  static const bool vnni = vnni_supported();
  return int4_product_with(x, codes, scales_and_minimums, vnni);
}

// The AVX2 variant on any CPU that has it, for the tests that pin it bitwise to the VNNI one.
at::Tensor int4_product_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_and_minimums) {
  return int4_product_with(x, codes, scales_and_minimums, false);
}

TORCH_LIBRARY_FRAGMENT(antiphon_cpu, m) {
  m.def("int4_product_supported() -> bool", &int4_product_supported);
  m.def("int4_product_isa() -> str", &int4_product_isa);
  m.def("int4_product_avx2(Tensor x, Tensor codes, Tensor scales_and_minimums) -> Tensor", &int4_product_avx2);
  m.def("int4_product(Tensor x, Tensor codes, Tensor scales_and_minimums) -> Tensor", &int4_product);
}
