// Decode attention that reads the paged KV cache in place, for CPU decode steps of models
// whose layers run native products, 4-bit or exact mode's float32
// (workers/cpu/native_attention.py says when).
//
// The torch path gathers every row's context with index_select (a copy of its keys and values
// per layer) and runs SDPA over the padded batch; for single-token queries SDPA's CPU kernel
// spends most of its time around a pair of tiny matrix products per row and head. A 16-row
// step of the default model spent ~14 ms of its ~40 ms there. This computes each row from
// the cache rows its block table names, per KV head and partition of 256 positions (a work
// item each, so one long row still uses every thread): scores for the query heads sharing
// the KV head in one pass over its keys, softmax, weighted values in one pass over its values;
// a row of several partitions then merges them.
//
// Not bitwise SDPA's (its own summation order and exp): within float32 rounding of it, and
// exact mode's greedy tokens still equal transformers' (the test suite checks them). Each
// row's result depends only on its own query and context: the same whatever its batch or
// thread split, so the Python forwards and the C++ stack, which all call it, agree.
//
// The caches hold float32, or bfloat16 on request (--kv-cache-dtype bfloat16: half the bytes
// to read, workers/kv_cache_dtype.py), widened to float32 in registers, exactly.
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

#include "avx512_util.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define ANTIPHON_DECODE_ATTENTION 1
#include <immintrin.h>
#endif

namespace {
// A context is cut into partitions of this many positions, each a work item of its own (with
// its KV head), so that one long row still spreads over the threads; the partial results are
// merged after (as flash-decoding does). A fixed size, not one taken from the thread count, so
// a row's result is the same on any machine split and in any batch.
constexpr int64_t kPartition = 256;
}  // namespace

#ifdef ANTIPHON_DECODE_ATTENTION
namespace {

#define AVX512_TARGET __attribute__((target("avx512f")))

// e^x for x <= 0 (scores minus their maximum), within ~2 float32 ulps: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor series to r^7 / 7! (error below 2e-8), scaled by 2^n.
AVX512_TARGET __m512 exp_non_positive(__m512 x) {
  // Below this e^x is under float32's smallest denormal and rounds to zero; the clamp keeps
  // n * ln2 exact for scores that are -inf or far below their maximum.
  // (The constant first: max_ps returns its second operand when either is NaN, so a NaN
  // stays NaN, as in SDPA.)
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
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

// Query heads of one KV head computed in one pass over its keys and values (which are then
// read once per pass, not once per head): up to 4, fewer for larger heads so that a pass's
// queries or sums and one row of keys or values fit the 32 vector registers
// (heads_per_pass); a group of 7 heads of 64 takes passes of 4 and 3.
constexpr int kMaxHeadsPerPass = 4;
// How many positions ahead the keys and values are prefetched.
constexpr int64_t kPrefetchAhead = 8;
// The loops over heads and chunks are unrolled (#pragma GCC unroll) so that the queries and
// sums stay in registers (at -O2 GCC would keep them on the stack).

// Where each position of a partition's keys and values lies in the caches (in elements).
struct Partition {
  const int64_t* offsets;
  int64_t length;
};

// One head's row of CHUNKS * 16 elements into registers as float32.
template <int CHUNKS>
AVX512_TARGET inline void load_row(const float* row, __m512* out) {
  #pragma GCC unroll 16
  for (int c = 0; c < CHUNKS; ++c) out[c] = _mm512_loadu_ps(row + 16 * c);
}

template <int CHUNKS>
AVX512_TARGET inline void load_row(const c10::BFloat16* row, __m512* out) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  #pragma GCC unroll 16
  for (int c = 0; c < CHUNKS; ++c) out[c] = antiphon::load_bfloat16(bits + 16 * c);
}

// HEADS query heads over one partition: for each head, the largest score, the sum of the
// exponentials, and the unnormalised weighted values, for CHUNKS * 16 = head_dim.
template <typename Element, int CHUNKS, int HEADS>
AVX512_TARGET void attend_partition(const float* const* queries, const void* key_cache, const void* value_cache,
                                    Partition part, float scale, float* scores, float* largest, float* totals,
                                    float* const* sums) {
  const Element* keys = static_cast<const Element*>(key_cache);
  const Element* values = static_cast<const Element*>(value_cache);
  constexpr int kRowBytes = CHUNKS * 16 * static_cast<int>(sizeof(Element));
  const int64_t length = part.length;
  __m512 query[HEADS][CHUNKS];
  #pragma GCC unroll 16
  for (int h = 0; h < HEADS; ++h) load_row<CHUNKS>(queries[h], query[h]);
  #pragma GCC unroll 16
  for (int h = 0; h < HEADS; ++h) largest[h] = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < length; ++j) {
    // The context's rows are scattered over blocks: fetch a few positions ahead (their keys
    // now, their values for the pass below) rather than wait on each row's lines in turn.
    if (j + kPrefetchAhead < length) {
      const int64_t ahead = part.offsets[j + kPrefetchAhead];
      #pragma GCC unroll 16
      for (int byte = 0; byte < kRowBytes; byte += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(keys + ahead) + byte, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(values + ahead) + byte, _MM_HINT_T1);
      }
    }
    __m512 k[CHUNKS];
    load_row<CHUNKS>(keys + part.offsets[j], k);
    #pragma GCC unroll 16
    for (int h = 0; h < HEADS; ++h) {
      __m512 dot = _mm512_mul_ps(query[h][0], k[0]);
      #pragma GCC unroll 16
      for (int c = 1; c < CHUNKS; ++c) dot = _mm512_fmadd_ps(query[h][c], k[c], dot);
      const float score = _mm512_reduce_add_ps(dot) * scale;
      scores[h * kPartition + j] = score;
      // A NaN score never becomes the largest; it reaches the output through its own weight.
      largest[h] = std::max(largest[h], score);
    }
  }
  #pragma GCC unroll 16
  for (int h = 0; h < HEADS; ++h) {
    float* head_scores = scores + h * kPartition;
    const __m512 shift = _mm512_set1_ps(largest[h]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < length; j += 16) {
      const __mmask16 lanes = length - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (length - j)) - 1);
      const __m512 weights = exp_non_positive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, head_scores + j), shift));
      total = _mm512_mask_add_ps(total, lanes, total, weights);
      _mm512_mask_storeu_ps(head_scores + j, lanes, weights);
    }
    totals[h] = _mm512_reduce_add_ps(total);
  }
  __m512 sum[HEADS][CHUNKS];
  #pragma GCC unroll 16
  for (int h = 0; h < HEADS; ++h)
    #pragma GCC unroll 16
    for (int c = 0; c < CHUNKS; ++c) sum[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; ++j) {
    __m512 v[CHUNKS];
    load_row<CHUNKS>(values + part.offsets[j], v);
    #pragma GCC unroll 16
    for (int h = 0; h < HEADS; ++h) {
      const __m512 weight = _mm512_set1_ps(scores[h * kPartition + j]);
      #pragma GCC unroll 16
      for (int c = 0; c < CHUNKS; ++c) sum[h][c] = _mm512_fmadd_ps(weight, v[c], sum[h][c]);
    }
  }
  #pragma GCC unroll 16
  for (int h = 0; h < HEADS; ++h)
    #pragma GCC unroll 16
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(sums[h] + 16 * c, sum[h][c]);
}

using PartitionFunction = void (*)(const float* const*, const void*, const void*, Partition, float, float*, float*,
                                   float*, float* const*);

template <typename Element, int CHUNKS>
PartitionFunction partition_function(int heads) {
  switch (heads) {
    case 1: return attend_partition<Element, CHUNKS, 1>;
    case 2: return attend_partition<Element, CHUNKS, 2>;
    case 3: return attend_partition<Element, CHUNKS, 3>;
    default: return attend_partition<Element, CHUNKS, 4>;
  }
}

// Heads of head_dim per pass: (heads + 1) * head_dim / 16 registers at most 24.
int heads_per_pass(int64_t head_dim) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxHeadsPerPass, 24 / (head_dim / 16) - 1)));
}

template <typename Element>
PartitionFunction partition_function(int64_t head_dim, int heads) {
  switch (head_dim) {
    case 16: return partition_function<Element, 1>(heads);
    case 32: return partition_function<Element, 2>(heads);
    case 64: return partition_function<Element, 4>(heads);
    case 80: return partition_function<Element, 5>(heads);
    case 96: return partition_function<Element, 6>(heads);
    case 128: return partition_function<Element, 8>(heads);
    case 256: return partition_function<Element, 16>(heads);
    default: return nullptr;
  }
}

// For caches of this dtype (float32 or bfloat16).
PartitionFunction partition_function(at::ScalarType dtype, int64_t head_dim, int heads) {
  return dtype == at::kBFloat16 ? partition_function<c10::BFloat16>(head_dim, heads)
                                : partition_function<float>(head_dim, heads);
}

}  // namespace
#endif  // ANTIPHON_DECODE_ATTENTION

bool decode_attention_supported(int64_t head_dim) {
#ifdef ANTIPHON_DECODE_ATTENTION
  return antiphon::avx512f_supported() && partition_function(at::kFloat, head_dim, 1) != nullptr;
#else
  (void)head_dim;
  return false;
#endif
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double scale) {
  TORCH_CHECK(q.is_cpu() && key_cache.is_cpu() && value_cache.is_cpu() && block_tables.is_cpu() &&
                  context_lens.is_cpu(),
              "decode attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be [rows, heads, head_dim] float32");
  const at::ScalarType cache_dtype = key_cache.scalar_type();
  TORCH_CHECK(key_cache.dim() == 3 &&
                  (cache_dtype == at::kFloat || cache_dtype == at::kBFloat16) &&
                  key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.scalar_type() == cache_dtype && value_cache.is_contiguous(),
              "the caches must be contiguous [slots, kv_heads, head_dim] of one shape and one dtype, float32 or "
              "bfloat16");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t slots = key_cache.size(0), kv_heads = key_cache.size(1);
  TORCH_CHECK(key_cache.size(2) == head_dim, "q's head_dim ", head_dim, ", the cache's ", key_cache.size(2));
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads cannot share ", kv_heads, " KV heads");
  TORCH_CHECK(block_size > 0 && slots % block_size == 0, "the caches' ", slots, " slots are not whole blocks of ",
              block_size);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == rows && block_tables.scalar_type() == at::kLong,
              "block_tables must be [rows, blocks] int64");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == rows && context_lens.scalar_type() == at::kLong,
              "context_lens must be [rows] int64");
  TORCH_CHECK(decode_attention_supported(head_dim), "decode attention needs AVX-512F and a head_dim of 16, 32, 64, "
              "80, 96, 128 or 256; got ", head_dim);
  const at::Tensor query = q.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const int64_t table_width = tables.size(1), num_blocks = slots / block_size;
  // Copied once: the lengths checked are the lengths used, whatever else holds the tensor.
  const at::Tensor lens = context_lens.contiguous();
  const std::vector<int64_t> lengths(lens.data_ptr<int64_t>(), lens.data_ptr<int64_t>() + rows);
  const int64_t* len_data = lengths.data();
  // Row r's work items are [first_item[r], first_item[r + 1]): its partitions times KV heads.
  std::vector<int64_t> first_item(rows + 1, 0);
  bool split = false;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t length = len_data[r];
    TORCH_CHECK(length >= 1 && length <= table_width * block_size, "row ", r, "'s context length ", length,
                " is outside 1..", table_width * block_size, " (its block table's)");
    const int64_t partitions = (length + kPartition - 1) / kPartition;
    split = split || partitions > 1;
    first_item[r + 1] = first_item[r] + partitions * kv_heads;
  }
  at::Tensor out = at::empty({rows, heads, head_dim}, query.options());
#ifdef ANTIPHON_DECODE_ATTENTION
  const int64_t group = heads / kv_heads, per_pass = heads_per_pass(head_dim);
  const float* q_data = query.data_ptr<float>();
  const void* key_data = key_cache.data_ptr();
  const void* value_data = value_cache.data_ptr();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  float* out_data = out.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  // Rows of several partitions leave each partition's (largest, total, weighted values) per
  // query head here, merged below.
  constexpr int64_t kPartial = 2;  // floats before the values: largest score, total weight
  at::Tensor partials = split ? at::empty({first_item[rows], group, kPartial + head_dim}, query.options())
                              : at::Tensor();
  float* partial_data = split ? partials.data_ptr<float>() : nullptr;
  std::atomic<bool> bad_block{false};
  at::parallel_for(0, first_item[rows], 1, [&](int64_t first, int64_t last) {
    std::vector<int64_t> offsets(kPartition);
    std::vector<float> scores(kMaxHeadsPerPass * kPartition), weighted(kMaxHeadsPerPass * head_dim);
    for (int64_t item = first; item < last; ++item) {
      const int64_t r = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t within = item - first_item[r], g = within % kv_heads, p = within / kv_heads;
      const int64_t begin = p * kPartition, length = std::min(len_data[r] - begin, kPartition);
      const bool whole = len_data[r] <= kPartition;
      const int64_t* table = table_data + r * table_width;
      for (int64_t j = 0; j < length; ++j) {
        const int64_t position = begin + j, block = table[position / block_size];
        if (block < 0 || block >= num_blocks) {
          bad_block = true;
          return;
        }
        offsets[j] = ((block * block_size + position % block_size) * kv_heads + g) * head_dim;
      }
      for (int64_t h0 = 0; h0 < group; h0 += per_pass) {
        const int pass = static_cast<int>(std::min<int64_t>(group - h0, per_pass));
        const float* queries[kMaxHeadsPerPass];
        float* sums[kMaxHeadsPerPass];
        float largest[kMaxHeadsPerPass], totals[kMaxHeadsPerPass];
        for (int h = 0; h < pass; ++h) {
          queries[h] = q_data + (r * heads + g * group + h0 + h) * head_dim;
          sums[h] = weighted.data() + h * head_dim;
        }
        const PartitionFunction attend_pass = partition_function(cache_dtype, head_dim, pass);
        attend_pass(queries, key_data, value_data, Partition{offsets.data(), length}, scale_f, scores.data(), largest,
                    totals, sums);
        for (int h = 0; h < pass; ++h) {
          if (whole) {
            float* dst = out_data + (r * heads + g * group + h0 + h) * head_dim;
            const float inverse = 1.0f / totals[h];
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = sums[h][d] * inverse;
          } else {
            float* dst = partial_data + (item * group + h0 + h) * (kPartial + head_dim);
            dst[0] = largest[h];
            dst[1] = totals[h];
            std::copy(sums[h], sums[h] + head_dim, dst + kPartial);
          }
        }
      }
    }
  });
  TORCH_CHECK(!bad_block, "a block table names a block outside the cache's ", num_blocks, " blocks");
  if (split) {
    // Each split row's heads: the partitions' weights rescaled to the overall largest score.
    at::parallel_for(0, rows * heads, 1, [&](int64_t first, int64_t last) {
      for (int64_t index = first; index < last; ++index) {
        const int64_t r = index / heads, h = index % heads, g = h / group, partitions = (first_item[r + 1] -
                                                                                          first_item[r]) / kv_heads;
        if (partitions == 1) continue;
        auto partial = [&](int64_t p) {
          return partial_data + ((first_item[r] + p * kv_heads + g) * group + h % group) * (kPartial + head_dim);
        };
        float overall = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < partitions; ++p) overall = std::max(overall, partial(p)[0]);
        float* dst = out_data + (r * heads + h) * head_dim;
        std::fill(dst, dst + head_dim, 0.0f);
        float total = 0.0f;
        for (int64_t p = 0; p < partitions; ++p) {
          const float* part = partial(p);
          const float factor = std::exp(part[0] - overall);
          total += part[1] * factor;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] += part[kPartial + d] * factor;
        }
        const float inverse = 1.0f / total;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] *= inverse;
      }
    });
  }
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(antiphon_cpu, m) {
  m.def("decode_attention_supported(int head_dim) -> bool", &decode_attention_supported);
  m.def("decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale) -> Tensor",
        &decode_attention);
}
