// The 4-bit product of int4_product.cpp with AVX2 integer dot products, for CPUs without
// AVX-512 VNNI. Without vpdpbusd, codes times int8 inputs go through vpmaddubsw (pairs of
// unsigned codes times signed inputs, summed to 16 bits) and vpmaddwd (pairs of those summed
// to 32 bits): four multiply-adds per output lane, as one vpdpbusd does, and the integer sums
// are exact either way (a group's eight vpmaddubsw results add up to at most
// 8 * 2 * 15 * 128 = 30720 in magnitude, inside 16 bits, even for int8's -128). The float arithmetic per output
// (each group's integer sum times scale * step, plus minimum * sum, as fused multiply-adds in
// group order) and the input's quantization are the VNNI variant's, operation for operation,
// so the two give bitwise the same results (tests/test_cpu_int4.py compares them where a CPU
// has both).
//
// A tile's 16 outputs take two 256-bit halves of 8 lanes; each half runs over all groups on
// its own, so that its accumulators (one 16-bit and one float register per row, up to four
// rows) stay in AVX2's 16 registers.

#include "int4_product_avx2.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kHalf = 8;  // outputs per 256-bit register of int32 or float lanes
constexpr int64_t kMaxRowsPerPass = 4;

typedef int32_t FourInputs __attribute__((may_alias, aligned(1)));

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET inline float max_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

AVX2_TARGET inline int32_t sum_of(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

template <int ROWS>
AVX2_TARGET void product_tile(const int8_t* q, const float* steps, const float* sums, const uint8_t* codes,
                              const uint16_t* scales_and_minimums, float* y, int64_t k, int64_t n, int64_t row,
                              int64_t tile) {
  const int64_t groups = k / kGroup;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* tile_codes = codes + tile * groups * 4 * 64;
  const uint16_t* tile_scales = scales_and_minimums + tile * groups * 2 * kTile;
  for (int64_t half = 0; half < 2; ++half) {
    __m256 out[ROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) out[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i sum[ROWS];  // 16-bit lanes: two per output
      #pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) sum[r] = _mm256_setzero_si256();
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m256i packed =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile_codes + (g * 4 + p) * 64 + half * 32));
        const __m256i first = _mm256_and_si256(packed, low_nibbles);
        const __m256i second = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
        #pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) {
          const FourInputs* inputs = reinterpret_cast<const FourInputs*>(q + (row + r) * k + g * kGroup + p * 8);
          sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(first, _mm256_set1_epi32(inputs[0])));
          sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(second, _mm256_set1_epi32(inputs[1])));
        }
      }
      const uint16_t* group_scales = tile_scales + g * 2 * kTile + half * kHalf;
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group_scales)));
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group_scales + kTile)));
      #pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const __m256i total = _mm256_madd_epi16(sum[r], ones);
        const int64_t at = (row + r) * groups + g;
        const __m256 weighted = _mm256_mul_ps(scale, _mm256_set1_ps(steps[at]));
        out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), weighted, out[r]);
        out[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(sums[at]), out[r]);
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) _mm256_storeu_ps(y + (row + r) * n + tile * kTile + half * kHalf, out[r]);
  }
}

}  // namespace

bool int4_avx2_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    // F16C through cpuid: __builtin_cpu_supports names it only from GCC 11 and clang 18.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  }();
  return supported;
}

AVX2_TARGET void quantize_rows_avx2(const float* x, int64_t rows, int64_t k, int8_t* q, float* steps, float* sums) {
  const int64_t groups = k / kGroup;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // The order packing leaves the four registers' 32-bit quads in (see below), put back.
  const __m256i quads = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* in = x + r * k + g * kGroup;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(in + 8 * i);
      const __m256 largest = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      // A NaN anywhere in the group makes the step NaN (as in the VNNI variant): max
      // instructions pass NaN on or drop it depending on the operand order, which differs
      // between the two variants' reductions.
      const int unordered = _mm256_movemask_ps(_mm256_or_ps(
          _mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q), _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
          _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q), _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q))));
      const float amax = unordered != 0 ? NAN : max_of(largest);
      // As the VNNI variant: a group of zeros, or one too small for 127 / amax, gets codes 0.
      const float ratio = 127.0f / amax;
      const float inverse = amax > 0.0f && std::isfinite(ratio) ? ratio : 0.0f;
      const float step = amax / 127.0f;
      __m256i c[4];
      for (int i = 0; i < 4; ++i) {
        c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)), kNearest));
      }
      const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
      steps[r * groups + g] = step;
      sums[r * groups + g] = step * static_cast<float>(sum_of(total));
      // Codes lie in -127..127: the saturating packs keep them. Packing works within 128-bit
      // halves, which leaves the 32 bytes as quads c0[0:4] c1[0:4] c2[0:4] c3[0:4] c0[4:8] ...
      const __m256i packed =
          _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * k + g * kGroup),
                          _mm256_permutevar8x32_epi32(packed, quads));
    }
  }
}

AVX2_TARGET void product_tile_rows_avx2(const int8_t* q, const float* steps, const float* sums, const uint8_t* codes,
                                        const uint16_t* scales_and_minimums, float* y, int64_t k, int64_t n,
                                        int64_t tile, int64_t first_row, int64_t last_row) {
  for (int64_t row = first_row; row < last_row; row += kMaxRowsPerPass) {
    switch (std::min(last_row - row, kMaxRowsPerPass)) {
      case 1: product_tile<1>(q, steps, sums, codes, scales_and_minimums, y, k, n, row, tile); break;
      case 2: product_tile<2>(q, steps, sums, codes, scales_and_minimums, y, k, n, row, tile); break;
      case 3: product_tile<3>(q, steps, sums, codes, scales_and_minimums, y, k, n, row, tile); break;
      default: product_tile<4>(q, steps, sums, codes, scales_and_minimums, y, k, n, row, tile); break;
    }
  }
}

#else  // not x86-64: never called (int4_avx2_supported() is false)

bool int4_avx2_supported() { return false; }
void quantize_rows_avx2(const float*, int64_t, int64_t, int8_t*, float*, float*) {}
void product_tile_rows_avx2(const int8_t*, const float*, const float*, const uint8_t*, const uint16_t*, float*,
                            int64_t, int64_t, int64_t, int64_t, int64_t) {}

#endif
