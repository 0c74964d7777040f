// Small AVX-512F helpers shared by the native kernels.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#define ANTIPHON_AVX512_UTIL 1
#include <immintrin.h>

namespace antiphon {

constexpr int64_t kLanes = 16;  // floats in a 512-bit register

// Whether this CPU has AVX-512F (asked once).
inline bool avx512f_supported() {
  static const bool avx512 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return avx512;
}

// The lanes of a chunk that hold elements when `left` of them remain (all 16, or the first `left`).
inline __mmask16 lanes_left(int64_t left) {
  return left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// sum(a[i] * b[i]) over k floats: four chains of fused multiply-adds over 16-lane chunks
// (chunk c on chain c % 4, in input order; a last partial chunk reads zeros past k), the
// chains added pairwise, the lanes summed in a fixed tree. The result depends on the values only.
__attribute__((target("avx512f"))) inline float sum_of_products(const float* a, const float* b, int64_t k) {
  __m512 chains[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const int64_t chunks = (k + kLanes - 1) / kLanes;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 mask = lanes_left(k - c * kLanes);
    chains[c % 4] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + c * kLanes), _mm512_maskz_loadu_ps(mask, b + c * kLanes),
                                    chains[c % 4]);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(chains[0], chains[1]), _mm512_add_ps(chains[2], chains[3])));
}

// 16 bfloat16 values (raw bits) widened to float32: exact, a bfloat16 being a float32's top half.
__attribute__((target("avx512f"))) inline __m512 load_bfloat16(const uint16_t* at) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 float32 values rounded to bfloat16 (raw bits), to nearest, ties to even, as torch's
// .to(torch.bfloat16) rounds them: overflow goes to infinity. A NaN becomes the quiet NaN
// 0x7FC0, as c10::BFloat16 (torch's scalar conversion) makes it; torch's vectorized one writes
// 0xFFFF: a NaN either way.
__attribute__((target("avx512f"))) inline void store_bfloat16(uint16_t* at, __m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lowest_kept));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
  const __m512i top = _mm512_mask_blend_epi32(is_nan, _mm512_srli_epi32(rounded, 16), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm512_cvtepi32_epi16(top));
}

}  // namespace antiphon
#endif  // x86-64
