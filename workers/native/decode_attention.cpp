// Decode attention that reads the paged KV cache in place, for CPU decode steps of models
// whose 4-bit layers run the native kernel (workers/cpu_decode_attention.py says when).
//
// The torch path gathers every row's context with index_select (a copy of its keys and values
// per layer) and runs SDPA over the padded batch; for single-token queries SDPA's CPU kernel
// spends most of its time around a pair of tiny matrix products per row and head. A 16-row
// step of the default model spent ~14 ms of its ~40 ms there. This computes each (row, KV
// head) pair directly from the cache rows its slots name: scores, softmax, weighted values.
//
// Not bitwise SDPA's (its own summation order and exp), so exact mode never takes it. Each
// row's result depends only on its own query and context: the same whatever its batch,
// padding or thread split, so the Python forwards and the C++ stack, which all call it, agree.
//
// x86-64 with AVX-512F only (per-function target, so the library still loads elsewhere);
// decode_attention_supported() says whether this CPU runs it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "decode_attention.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define ANTIPHON_DECODE_ATTENTION 1
#include <immintrin.h>
#endif

#ifdef ANTIPHON_DECODE_ATTENTION
namespace {

#define AVX512_TARGET __attribute__((target("avx512f")))

// e^x for x <= 0 (scores minus their maximum), within ~2 float32 ulps: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor series to r^7 / 7! (error below 2e-8), scaled by 2^n.
AVX512_TARGET __m512 exp_non_positive(__m512 x) {
  // Below this e^x is under float32's smallest normal and rounds to a denormal or zero; the
  // clamp keeps n * ln2 exact for scores that are -inf or far below their maximum.
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts: the high one has few enough bits that n * high is exact.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One query head over one context: out[D] = softmax(scale * q . K) V, for CHUNKS * 16 = D.
// `keys[j]` and `values[j]` point at context position j's row of this head; `scores` holds
// at least `length` floats.
template <int CHUNKS>
AVX512_TARGET void attend_head(const float* q, const float* const* keys, const float* const* values, int64_t length,
                               float scale, float* scores, float* out) {
  __m512 query[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) query[c] = _mm512_loadu_ps(q + 16 * c);
  float largest = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < length; ++j) {
    __m512 dot = _mm512_mul_ps(query[0], _mm512_loadu_ps(keys[j]));
    for (int c = 1; c < CHUNKS; ++c) dot = _mm512_fmadd_ps(query[c], _mm512_loadu_ps(keys[j] + 16 * c), dot);
    scores[j] = _mm512_reduce_add_ps(dot) * scale;
    largest = std::max(largest, scores[j]);
  }
  // A NaN score (from a NaN query or key) leaves `largest` finite or -inf; the NaN still
  // reaches the output through its own weight, as in SDPA.
  const __m512 shift = _mm512_set1_ps(largest);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; j += 16) {
    const __mmask16 lanes = length - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (length - j)) - 1);
    const __m512 weights = exp_non_positive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + j), shift));
    total = _mm512_mask_add_ps(total, lanes, total, weights);
    _mm512_mask_storeu_ps(scores + j, lanes, weights);
  }
  __m512 sum[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) sum[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; ++j) {
    const __m512 weight = _mm512_set1_ps(scores[j]);
    for (int c = 0; c < CHUNKS; ++c) sum[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(values[j] + 16 * c), sum[c]);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(sum[c], inverse));
}

using HeadFunction = void (*)(const float*, const float* const*, const float* const*, int64_t, float, float*, float*);

HeadFunction head_function(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend_head<1>;
    case 32: return attend_head<2>;
    case 64: return attend_head<4>;
    case 80: return attend_head<5>;
    case 96: return attend_head<6>;
    case 128: return attend_head<8>;
    case 256: return attend_head<16>;
    default: return nullptr;
  }
}

}  // namespace
#endif  // ANTIPHON_DECODE_ATTENTION

bool decode_attention_supported(int64_t head_dim) {
#ifdef ANTIPHON_DECODE_ATTENTION
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && head_function(head_dim) != nullptr;
#else
  (void)head_dim;
  return false;
#endif
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& context_slots, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.is_cpu() && key_cache.is_cpu() && value_cache.is_cpu() && context_slots.is_cpu() &&
                  context_lens.is_cpu(),
              "decode attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be [rows, heads, head_dim] float32");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.scalar_type() == at::kFloat && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == at::kFloat &&
                  value_cache.is_contiguous(),
              "the caches must be contiguous [slots, kv_heads, head_dim] float32 of one shape");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t slots = key_cache.size(0), kv_heads = key_cache.size(1);
  TORCH_CHECK(key_cache.size(2) == head_dim, "q's head_dim ", head_dim, ", the cache's ", key_cache.size(2));
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads cannot share ", kv_heads, " KV heads");
  TORCH_CHECK(context_slots.dim() == 2 && context_slots.size(0) == rows && context_slots.scalar_type() == at::kLong,
              "context_slots must be [rows, length] int64");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == rows && context_lens.scalar_type() == at::kLong,
              "context_lens must be [rows] int64");
  TORCH_CHECK(decode_attention_supported(head_dim), "decode attention needs AVX-512F and a head_dim of 16, 32, 64, "
              "80, 96, 128 or 256; got ", head_dim);
  const at::Tensor query = q.contiguous();
  const at::Tensor slot_table = context_slots.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t width = slot_table.size(1);
  const int64_t* len_data = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(len_data[r] >= 1 && len_data[r] <= width, "row ", r, "'s context length ", len_data[r],
                " is outside 1..", width);
  }
  at::Tensor out = at::empty({rows, heads, head_dim}, query.options());
#ifdef ANTIPHON_DECODE_ATTENTION
  const HeadFunction attend = head_function(head_dim);
  const int64_t group = heads / kv_heads;
  const float* q_data = query.data_ptr<float>();
  const float* key_data = key_cache.data_ptr<float>();
  const float* value_data = value_cache.data_ptr<float>();
  const int64_t* slot_data = slot_table.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  std::atomic<bool> bad_slot{false};
  // One work item per (row, KV head): its query heads read the same cache rows.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<const float*> keys, values;
    std::vector<float> scores;
    for (int64_t item = first; item < last; ++item) {
      const int64_t r = item / kv_heads, g = item % kv_heads, length = len_data[r];
      keys.resize(length);
      values.resize(length);
      scores.resize(length);
      const int64_t* row_slots = slot_data + r * width;
      for (int64_t j = 0; j < length; ++j) {
        const int64_t slot = row_slots[j];
        if (slot < 0 || slot >= slots) {
          bad_slot = true;
          return;
        }
        const int64_t offset = (slot * kv_heads + g) * head_dim;
        keys[j] = key_data + offset;
        values[j] = value_data + offset;
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const int64_t at_head = (r * heads + h) * head_dim;
        attend(q_data + at_head, keys.data(), values.data(), length, scale_f, scores.data(), out_data + at_head);
      }
    }
  });
  TORCH_CHECK(!bad_slot, "a context slot lies outside the cache's ", slots, " slots");
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(antiphon_cpu, m) {
  m.def("decode_attention_supported(int head_dim) -> bool", &decode_attention_supported);
  m.def("decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor context_slots, "
        "Tensor context_lens, float scale) -> Tensor",
        &decode_attention);
}
