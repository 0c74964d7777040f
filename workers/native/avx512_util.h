// Small AVX-512F helpers shared by rms_norm.cpp and rescore_top.cpp.
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

}  // namespace antiphon
#endif  // x86-64
