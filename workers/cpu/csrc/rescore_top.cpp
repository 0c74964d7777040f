// Each row's highest approximate logits, recomputed in float32 (workers/cpu/output_layer.py).
//
// Outside exact mode the output matrix is read in bfloat16 or, in greedy steps, 4 bits; the
// rows' top candidates are then recomputed from the float32 weights. In torch that is a topk
// over the vocabulary (~60 us a row for 49152 logits and 32 candidates here), a gather of the
// candidates' weight rows and a batched product: ~1.5 ms of a 16-row step. Here, per row, one
// pass over the logits keeps the candidates (a 16-lane compare against the lowest kept value
// skips almost every logit), then each candidate's dot product reads its weight row in place.
//
// The candidates come back in ascending index order, so the first maximum among their float32
// logits is the one an argmax over the whole row picks (the lowest index). Each dot product is
// four chains of fused multiply-adds over 16-lane chunks, in input order, the chains then
// added pairwise and the lanes summed in a fixed tree: a row's values depend on that row only.
// Ties at the cut (equal logits for the last places) keep the earliest indices; NaN ranks
// above every number, as in torch.topk.
//
// x86-64 with AVX-512F only (per-function target); elsewhere rescore_top_supported() is false.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "avx512_util.h"

#ifdef ANTIPHON_AVX512_UTIL
namespace {

using antiphon::kLanes;

// The order the candidates are kept by: NaN above every number, as torch.topk ranks it.
inline bool ranks_below(float a, float b) { return !std::isnan(a) && (std::isnan(b) || a < b); }

// The `count` highest of `values[0, n)` into `indices` (ascending). count <= n.
__attribute__((target("avx512f"))) void top_indices(const float* values, int64_t n, int64_t count, int64_t* indices) {
  std::vector<float> kept(values, values + count);
  std::vector<int64_t> at(count);
  std::iota(at.begin(), at.end(), 0);
  // The kept value to give up next: the lowest, and of equal ones the latest index.
  const auto next_out = [&] {
    int64_t out = 0;
    for (int64_t j = 1; j < count; ++j) {
      if (ranks_below(kept[j], kept[out]) || (!ranks_below(kept[out], kept[j]) && at[j] > at[out])) out = j;
    }
    return out;
  };
  int64_t lowest = next_out();
  float threshold = kept[lowest];
  const auto offer = [&](int64_t i) {
    // Strictly above: on equal values the earlier index stays.
    if (!ranks_below(threshold, values[i])) return;
    kept[lowest] = values[i];
    at[lowest] = i;
    lowest = next_out();
    threshold = kept[lowest];
  };
  int64_t i = count;
  // Scalar up to a 16-aligned index, then whole chunks compared at once: lanes above the
  // threshold or unordered (a NaN on either side) are offered, the rest skipped.
  for (; i < n && i % kLanes != 0; ++i) offer(i);
  for (; i + kLanes <= n; i += kLanes) {
    __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(values + i), _mm512_set1_ps(threshold), _CMP_NLE_UQ);
    while (above) {
      offer(i + __builtin_ctz(above));
      above &= above - 1;
    }
  }
  for (; i < n; ++i) offer(i);
  std::sort(at.begin(), at.end());
  std::copy(at.begin(), at.end(), indices);
}

}  // namespace
#endif  // ANTIPHON_AVX512_UTIL

// logits [rows, vocab] float32 (approximate), x [rows, hidden] float32, weight [vocab, hidden]
// float32, bias [vocab] or none -> (indices [rows, candidates] int64, ascending, of each row's
// `candidates` highest logits; their float32 logits x . weight[index] + bias[index]).
bool rescore_top_supported() {
#ifdef ANTIPHON_AVX512_UTIL
  return antiphon::avx512f_supported();
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> rescore_top(const at::Tensor& logits, const at::Tensor& x,
                                               const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                               int64_t candidates) {
  TORCH_CHECK(rescore_top_supported(), "this CPU lacks AVX-512F");
  TORCH_CHECK(logits.is_cpu() && x.is_cpu() && weight.is_cpu(), "the rescoring runs on CPU tensors");
  TORCH_CHECK(logits.dim() == 2 && x.dim() == 2 && weight.dim() == 2, "logits, x and weight are matrices");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "logits, x and weight must be float32");
  const int64_t rows = logits.size(0), vocab = logits.size(1), hidden = x.size(1);
  TORCH_CHECK(x.size(0) == rows, "x has ", x.size(0), " rows, the logits ", rows);
  TORCH_CHECK(weight.size(0) == vocab && weight.size(1) == hidden, "weight must be [vocab, hidden] = [", vocab, ", ",
              hidden, "]");
  TORCH_CHECK(candidates >= 1 && candidates <= vocab, "candidates must be in [1, vocab]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_cpu() && bias->dim() == 1 && bias->size(0) == vocab && bias->scalar_type() == at::kFloat,
                "bias must be [vocab] float32");
  }
  const at::Tensor l = logits.contiguous(), in = x.contiguous(), w = weight.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor indices = at::empty({rows, candidates}, logits.options().dtype(at::kLong));
  at::Tensor values = at::empty({rows, candidates}, logits.options());
#ifdef ANTIPHON_AVX512_UTIL
  const float* l_data = l.data_ptr<float>();
  const float* x_data = in.data_ptr<float>();
  const float* w_data = w.data_ptr<float>();
  const float* b_data = b.defined() ? b.data_ptr<float>() : nullptr;
  int64_t* i_data = indices.data_ptr<int64_t>();
  float* v_data = values.data_ptr<float>();
  // One row per task: a row is ~50 us of work here, worth a second thread from two rows on.
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      int64_t* row_indices = i_data + r * candidates;
      top_indices(l_data + r * vocab, vocab, candidates, row_indices);
      for (int64_t c = 0; c < candidates; ++c) {
        const int64_t token = row_indices[c];
        float value = antiphon::sum_of_products(x_data + r * hidden, w_data + token * hidden, hidden);
        if (b_data != nullptr) value += b_data[token];
        v_data[r * candidates + c] = value;
      }
    }
  });
#endif
  return {indices, values};
}

TORCH_LIBRARY_FRAGMENT(antiphon_cpu, m) {
  m.def("rescore_top_supported() -> bool", &rescore_top_supported);
  m.def("rescore_top(Tensor logits, Tensor x, Tensor weight, Tensor? bias, int candidates) -> (Tensor, Tensor)",
        &rescore_top);
}
