// The decoder layers of a decode step as one C++ call (workers/cpu/decode_stack.py).
//
// It makes the ATen calls of workers/cpu/lean_forward.py, in the same order on the same values,
// except the rotary embedding, one loop here that rounds as ATen's eight calls do, a batch's
// ATen norms, split by rows between the threads (the same calls per chunk, rounding alike),
// and the cache writes, a copy per row where index_copy_ copies the same floats; the native
// kernels it calls (norm, products, attention) are the ones the Python forwards call too. So
// its logits are bitwise the lean forward's and the model's own. What it takes
// away is Python: the lean forward makes ~30 torch calls per layer from Python, each paying
// argument parsing and dispatch from the interpreter, and on a CPU that is most of a one-row
// step of a small model.
//
// On two or more threads, a step with enough rows for every thread whose calls all compute each
// row from that row alone runs as one part of its rows per thread, each part through every layer on its own
// (DecodeStack::forward_split): the same logits, without the threads meeting around each call.
//
// It covers a pure decode step whose rows attend in one group (one stream, or streams of
// similar lengths; any lengths where the native decode attention serves, which the Python
// forwards then call too: native_attention.py), the layers' products being 4-bit
// (int4.py: torch's kernel or int4_product.cpp's), oneDNN-packed (packed_linear.py) or
// float32 on float32_product.cpp (float32_linear.py), and their norms fused
// (rms_norm.py: ATen's or rms_norm.cpp, as the model's modules run them). Everything else
// takes the Python forward.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

#include "decode_attention.h"
#include "float32_product.h"
#include "int4_product.h"
#include "rms_norm.h"

#include "avx512_util.h"

// The rotary loop below must round each product and sum as ATen's separate calls do (no
// fused multiply-add), whatever the build flags (native_library.py passes -ffp-contract=off too).
#pragma GCC optimize("fp-contract=off")

namespace {

// How a product is computed (lean_forward._product computes each kind the same way), from the
// kinds' one definition, which Python reads too (workers/cpu/product_kinds.py).
enum ProductKind : int64_t {
#define PRODUCT_KIND(name, value, four_bit) k##name = value,
#include "product_kinds.def"
#undef PRODUCT_KIND
};

// The kinds' values in file order: a step's row layout has one entry per kind, indexed by value,
// so the values must be 0, 1, 2, ... in order (product_kinds.py checks the same).
constexpr int64_t kProductKindValues[] = {
#define PRODUCT_KIND(name, value, four_bit) value,
#include "product_kinds.def"
#undef PRODUCT_KIND
};
constexpr int64_t kProductKinds = sizeof(kProductKindValues) / sizeof(kProductKindValues[0]);
constexpr bool kinds_numbered_in_order() {
  for (int64_t i = 0; i < kProductKinds; ++i) {
    if (kProductKindValues[i] != i) return false;
  }
  return true;
}
static_assert(kinds_numbered_in_order(), "product_kinds.def: kinds must be numbered 0, 1, 2, ... in order");

bool is_int4(int64_t kind) {
#define PRODUCT_KIND(name, value, four_bit) \
  if (kind == value) return four_bit;
#include "product_kinds.def"
#undef PRODUCT_KIND
  return false;
}

#ifdef ANTIPHON_AVX512_UTIL
__attribute__((target("avx512f"))) void round_chunks_to_bfloat16(const float* source, uint16_t* target,
                                                                 int64_t whole_chunks) {
  for (int64_t c = 0; c < whole_chunks; ++c) {
    antiphon::store_bfloat16(target + c * antiphon::kLanes, _mm512_loadu_ps(source + c * antiphon::kLanes));
  }
}
#endif

// `width` floats rounded to bfloat16 as c10::BFloat16, and so torch's .to(torch.bfloat16),
// rounds them: to nearest, ties to even.
void round_to_bfloat16(const float* source, c10::BFloat16* target, int64_t width) {
  int64_t done = 0;
#ifdef ANTIPHON_AVX512_UTIL
  if (antiphon::avx512f_supported()) {
    done = width / antiphon::kLanes * antiphon::kLanes;
    round_chunks_to_bfloat16(source, reinterpret_cast<uint16_t*>(target), width / antiphon::kLanes);
  }
#endif
  for (int64_t i = done; i < width; ++i) target[i] = c10::BFloat16(source[i]);
}

// Steps of at least this many rows split their norms between the threads (norm, below).
constexpr int64_t kRowsToSplit = 4;

// Steps split by rows between the threads (DecodeStack::forward_split) give each thread a part
// of at least this many rows, on any number of threads: each part reads all the weights, so a
// part must have enough rows for its arithmetic to outweigh that read, and every thread must
// get one (a step with fewer rows than that splits each call between all the threads instead,
// as a smaller step on more threads should: parts on some threads would leave the others idle).
// Rows per part is what decides it, not the thread count: each thread's part reads the weights
// at the same rows per read wherever it runs. Measured on the default model, two threads: 4-bit,
// 16 streams 1.3x split by rows, 8 streams 1.04-1.16x, 4 streams 0.75-0.8x; float32 (exact
// mode, 8 times the bytes per weight, a quarter of the multiply-adds per instruction), 16
// streams 1.09x, 8 streams 0.83x. (On many cores the threads share one memory bus, which two do
// less: the rule holds per thread only while the weights' reads do not saturate it; not measured
// above two threads.)
constexpr int64_t kMinRowsPerPartInt4 = 4;
constexpr int64_t kMinRowsPerPartFloat32 = 8;

// What a row's products cost, in positions of its decode attention: measured on the default
// model (4-bit, two threads), ~0.85 ms of products per row and ~2.5 us per position over its
// 30 layers. Only balances the parts (part_bounds); a wrong value costs time, never results.
constexpr double kPositionsPerRowOfProducts = 340.0;

// ATen's elementwise loops run in blocks of two vectors (32 float32s with AVX-512) and a scalar
// tail, whose exp (silu's) can round apart from the vectorized one. Where every piece a loop is
// given is whole blocks, nothing takes the tail (silu_rounds_alike).
constexpr int64_t kElementwiseBlock = 32;

// at::parallel_for over [0, end) whose chunks run with the calling thread's state (inference
// mode among it) on every thread.
template <typename F>
void parallel_with_state(int64_t end, int64_t grain, const F& chunk) {
  const at::ThreadLocalState state;
  at::parallel_for(0, end, grain, [&](int64_t first, int64_t last) {
    const at::ThreadLocalStateGuard guard(state);
    chunk(first, last);
  });
}

struct Product {
  int64_t kind;
  at::Tensor weight;  // 4-bit kinds: packed codes; packed kinds: the oneDNN weight; kNativeFloat32: tiled
  at::Tensor scales;  // 4-bit kinds only: torch's scales and zeros, or the native scales and minimums
  at::Tensor batched; // 4-bit kinds only: the oneDNN copy for more rows (bfloat16, or float32
                      // where the CPU has no bfloat16 product)
  c10::optional<at::Tensor> bias;
};

// Products of one input (q/k/v, o, gate/up, down), and for q/k/v and gate/up, where all are
// 4-bit, their codes side by side: one kernel call for small steps, bitwise the same columns.
struct ProductGroup {
  std::vector<Product> parts;
  // Whether the products need the bfloat16 copy of the input at every row count, or only
  // where rows take the native 4-bit kernel's copy: given by add_group, as lean_forward.py's
  // _ProductGroup decides it (one rule for both forwards).
  bool rounds_always = false, rounds_above = false;
  c10::optional<Product> fused;
  std::vector<int64_t> sizes;  // output columns of each part within the fused product
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  double input_eps, post_attention_eps, scaling;
  bool native_norm;  // the model's norms run rms_norm.cpp (rms_norm.py chose it at load)
  at::Tensor key_cache, value_cache;
  std::vector<ProductGroup> groups;  // q/k/v, o, gate/up, down
};

// cache[slots[t]] = rows[t] for rows [T, kv_heads, head_dim], each row's heads contiguous:
// what index_copy_ does, as one copy per row (index_copy_ costs ~5-9 us a call here, and a
// step makes two per layer). Slots are checked as index_copy_ checks them. A bfloat16 cache
// gets the rows rounded as paged_attention's rows.to(torch.bfloat16) rounds them. Registered as an
// op too, for the tests that pin it to index_copy_.
void write_kv_rows(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& rows) {
  const at::ScalarType dtype = cache.scalar_type();
  TORCH_CHECK(cache.is_cpu() && cache.dim() == 3 && cache.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "the cache must be contiguous [slots, kv_heads, head_dim] float32 or bfloat16 on the CPU");
  TORCH_CHECK(rows.dim() == 3, "rows to cache must be [tokens, kv_heads, head_dim]");
  const int64_t tokens = rows.size(0), width = cache.size(1) * cache.size(2), num_slots = cache.size(0);
  TORCH_CHECK(slots.is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens,
              "slot_mapping must be [tokens] int64 on the CPU");
  TORCH_CHECK(rows.is_cpu() && rows.scalar_type() == at::kFloat && rows.size(1) == cache.size(1) &&
                  rows.size(2) == cache.size(2) && (rows.size(2) <= 1 || rows.stride(2) == 1) &&
                  (rows.size(1) <= 1 || rows.stride(1) == cache.size(2)),
              "rows to cache must be [tokens, kv_heads, head_dim] float32, each row's heads contiguous");
  const at::Tensor index = slots.contiguous();
  const int64_t* slot = index.data_ptr<int64_t>();
  // All checked before any is written.
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is out of the cache's ", num_slots);
  }
  const float* source = rows.data_ptr<float>();
  if (dtype == at::kBFloat16) {
    c10::BFloat16* target = cache.data_ptr<c10::BFloat16>();
    for (int64_t t = 0; t < tokens; ++t) {
      round_to_bfloat16(source + t * rows.stride(0), target + slot[t] * width, width);
    }
    return;
  }
  float* target = cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(target + slot[t] * width, source + t * rows.stride(0), width * sizeof(float));
  }
}

}  // namespace

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t head_dim, int64_t group_size) : head_dim_(head_dim), group_size_(group_size) {}

  void add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_attention_norm, double post_attention_eps,
                 bool native_norm, double scaling, at::Tensor key_cache, at::Tensor value_cache) {
    for (const at::Tensor* cache : {&key_cache, &value_cache}) {
      TORCH_CHECK(cache->dim() == 3 && cache->is_contiguous() &&
                      (cache->scalar_type() == at::kFloat || cache->scalar_type() == at::kBFloat16) &&
                      cache->scalar_type() == key_cache.scalar_type() && cache->size(2) == head_dim_,
                  "KV caches must be contiguous [slots, kv_heads, head_dim] of one dtype: float32 or bfloat16");
    }
    TORCH_CHECK(!native_norm || rms_norm_supported(), "the native RMSNorm needs AVX-512F");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_attention_norm), input_eps, post_attention_eps,
                            scaling, native_norm, std::move(key_cache), std::move(value_cache), {}});
  }

  // Groups are appended to the last layer in the order q/k/v, o, gate/up, down; products to
  // the last group. The flags say when the group's input is rounded to bfloat16 (ProductGroup).
  void add_group(bool rounds_always, bool rounds_above) {
    TORCH_CHECK(!layers_.empty(), "add_layer first");
    layers_.back().groups.emplace_back();
    layers_.back().groups.back().rounds_always = rounds_always;
    layers_.back().groups.back().rounds_above = rounds_above;
  }

  void add_product(int64_t kind, at::Tensor weight, c10::optional<at::Tensor> scales,
                   c10::optional<at::Tensor> batched, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().groups.empty(), "add_group first");
    layers_.back().groups.back().parts.push_back(make_product(kind, std::move(weight), std::move(scales),
                                                              std::move(batched), std::move(bias)));
  }

  // The last group's parts as one 4-bit product (codes and scales concatenated along the
  // outputs), used in steps whose rows all take its kernel.
  void fuse_group(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> bias,
                  std::vector<int64_t> sizes) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().groups.empty(), "add_group first");
    ProductGroup& group = layers_.back().groups.back();
    TORCH_CHECK(!group.parts.empty() && sizes.size() == group.parts.size(), "one size per part");
    const int64_t kind = group.parts.front().kind;
    for (const Product& p : group.parts) TORCH_CHECK(is_int4(p.kind) && p.kind == kind, "fused parts are 4-bit, one kernel");
    group.fused = Product{kind, std::move(codes), std::move(scales), at::Tensor(), std::move(bias)};
    group.sizes = std::move(sizes);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Checked once after the last layer, not per step.
  void finish() {
    rows_independent_ = !layers_.empty();
    max_split_rows_ = std::numeric_limits<int64_t>::max();
    splits_need_native_int4_ = false;
    min_rows_per_part_ = kMinRowsPerPartInt4;
    mlp_widths_.clear();
    for (Layer& layer : layers_) {
      for (ProductGroup& group : layer.groups) {
        for (const Product& p : group.parts) {
          // Only the native kernels compute a row the same in any batch (oneDNN's blocking and
          // torch's 4-bit kernel may vary with the rows): the 4-bit one where the step's layout
          // puts every row on it, the float32 one below its oneDNN hand-off.
          rows_independent_ = rows_independent_ && (p.kind == kNativeInt4 || p.kind == kNativeFloat32);
          splits_need_native_int4_ = splits_need_native_int4_ || p.kind == kNativeInt4;
          if (p.kind == kNativeFloat32) {
            max_split_rows_ = std::min(max_split_rows_, kFloat32RowsForOneDNN - 1);
            min_rows_per_part_ = kMinRowsPerPartFloat32;
          }
        }
      }
      TORCH_CHECK(layer.groups.size() == 4, "a layer has 4 product groups, got ", layer.groups.size());
      TORCH_CHECK(layer.groups[0].parts.size() == 3 && layer.groups[1].parts.size() == 1 &&
                      layer.groups[2].parts.size() == 2 && layer.groups[3].parts.size() == 1,
                  "product groups are q/k/v, o, gate/up, down");
      // The MLP's inner width (silu's), where the stack may split rows: the down product's
      // inputs, 32 per 4-bit group or 16 per float32 chunk (the native layouts).
      const Product& down = layer.groups[3].parts.front();
      if (rows_independent_) {
        const int64_t width = down.weight.size(1) * (down.kind == kNativeInt4 ? 32 : 16);
        if (std::find(mlp_widths_.begin(), mlp_widths_.end(), width) == mlp_widths_.end()) {
          mlp_widths_.push_back(width);
        }
      }
    }
    finished_ = true;
  }

  // x [T, hidden] (the token embeddings); cos, sin [1, 1, T, head_dim]; slot_mapping [T];
  // kernel_rows: the step's row layout (workers/cpu/row_layout.py, StepRows.kernel_rows_by_kind):
  // per product kind, how many rows take its 4-bit kernel, all of them or none (the rest take its
  // copy; the stack computes decode steps, whose rows are all generated tokens); the entries of
  // kinds that are not 4-bit are unused.
  // Then the rows' contexts, for one of two attentions:
  //  - SDPA: context_slots [T, L]; context_mask [T, 1, 1, L] or None; context_start: for one
  //    row whose context fills slots [start, start + L) of the cache, start (read in place,
  //    no gather), else -1;
  //  - the native decode attention (decode_attention.cpp), which reads the caches in place:
  //    block_tables [T, W] and context_lens [T] int64, and the block size;
  // -> hidden states [T, hidden] after the last layer.
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                     const c10::optional<at::Tensor>& context_slots, const c10::optional<at::Tensor>& context_mask,
                     int64_t context_start, const c10::optional<at::Tensor>& block_tables,
                     const c10::optional<at::Tensor>& context_lens, int64_t block_size,
                     const std::vector<int64_t>& kernel_rows) {
    TORCH_CHECK(finished_, "finish() the stack first");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [tokens, hidden] float32");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 4 &&
                    cos.size(2) == x.size(0) && cos.size(3) == head_dim_ && cos.scalar_type() == at::kFloat,
                "cos and sin must be contiguous [1, 1, tokens, head_dim] float32");
    const bool native_attention = context_lens.has_value();
    TORCH_CHECK(native_attention ? block_tables.has_value() && !context_slots.has_value()
                                 : context_slots.has_value() && !block_tables.has_value(),
                "give context_slots (SDPA) or block_tables and context_lens (the native attention)");
    TORCH_CHECK(native_attention || context_start < 0 || context_slots->size(0) == 1,
                "an in-place context is one row's");
    const int64_t tokens = x.size(0);
    TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens, "slot_mapping must be [tokens]");
    TORCH_CHECK(static_cast<int64_t>(kernel_rows.size()) == kProductKinds, "kernel_rows needs one entry per product kind");
    for (int64_t kind = 0; kind < kProductKinds; ++kind) {
      TORCH_CHECK(!is_int4(kind) || kernel_rows[kind] == 0 || kernel_rows[kind] == tokens,
                  "a decode step's 4-bit rows take the kernel all or none; kind ", kind, " has ", kernel_rows[kind],
                  " of ", tokens);
    }
    TORCH_CHECK(!native_attention || (block_tables->dim() == 2 && block_tables->size(0) == tokens &&
                                      context_lens->dim() == 1 && context_lens->size(0) == tokens),
                "block_tables must be [tokens, blocks] and context_lens [tokens]");
    if (native_attention) {
      const std::vector<int64_t> bounds = row_parts(*context_lens, kernel_rows);
      if (bounds.size() > 2) return forward_split(x, cos, sin, slot_mapping, *block_tables, *context_lens, block_size,
                                                  kernel_rows, bounds);
    }
    return run_layers(x, cos, sin, slot_mapping, context_slots, context_mask, context_start, block_tables,
                      context_lens, block_size, kernel_rows);
  }

  // The row bounds of the parts a decode step with these context lengths and this row layout
  // runs in, one per thread (forward_split), or [0, rows] where it runs all its rows together.
  std::vector<int64_t> row_parts(const at::Tensor& context_lens, const std::vector<int64_t>& kernel_rows) const {
    TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kLong,
                "context_lens must be [rows] int64");
    TORCH_CHECK(static_cast<int64_t>(kernel_rows.size()) == kProductKinds, "kernel_rows needs one entry per product kind");
    const int64_t rows = context_lens.size(0);
    return splits_rows(rows, kernel_rows) ? part_bounds(context_lens) : std::vector<int64_t>{0, rows};
  }

  // How many steps ran split by rows (forward_split), for the tests.
  int64_t split_steps() const { return split_steps_.load(); }

 private:
  // The layers over x's rows: a whole step's, or a part's (forward_split).
  at::Tensor run_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                        const c10::optional<at::Tensor>& context_slots, const c10::optional<at::Tensor>& context_mask,
                        int64_t context_start, const c10::optional<at::Tensor>& block_tables,
                        const c10::optional<at::Tensor>& context_lens, int64_t block_size,
                        const std::vector<int64_t>& kernel_rows) const {
    const bool native_attention = context_lens.has_value();
    const int64_t tokens = x.size(0);
    const int64_t length = native_attention ? 0 : context_slots->size(1);
    const at::Tensor flat_slots = native_attention ? at::Tensor() : context_slots->reshape({-1});
    for (const Layer& layer : layers_) {
      at::Tensor h = norm(x, layer.input_norm, layer.input_eps, layer.native_norm);
      std::vector<at::Tensor> qkv = products(layer.groups[0], h, kernel_rows);
      at::Tensor q = rotate(qkv[0].view({1, tokens, -1, head_dim_}).transpose(1, 2), cos, sin);
      at::Tensor k = rotate(qkv[1].view({1, tokens, -1, head_dim_}).transpose(1, 2), cos, sin);
      at::Tensor v = qkv[2].view({1, tokens, -1, head_dim_}).transpose(1, 2);
      // paged_attention.attend, the one-group decode path.
      at::Tensor q_rows = q[0].transpose(0, 1);
      write_kv_rows(layer.key_cache, slot_mapping, k[0].transpose(0, 1));
      write_kv_rows(layer.value_cache, slot_mapping, v[0].transpose(0, 1));
      at::Tensor attended;
      if (native_attention) {
        attended = decode_attention(q_rows, layer.key_cache, layer.value_cache, *block_tables, *context_lens,
                                    block_size, layer.scaling);
      } else {
        at::Tensor keys = context(layer.key_cache, flat_slots, context_start, tokens, length).to(at::kFloat);
        at::Tensor values = context(layer.value_cache, flat_slots, context_start, tokens, length).to(at::kFloat);
        attended = at::scaled_dot_product_attention(q_rows.unsqueeze(2), keys, values, context_mask, 0.0, false,
                                                    layer.scaling, true)
                       .select(2, 0);
      }
      x = x + products(layer.groups[1], attended.reshape({tokens, -1}), kernel_rows)[0];
      h = norm(x, layer.post_attention_norm, layer.post_attention_eps, layer.native_norm);
      std::vector<at::Tensor> gate_up = products(layer.groups[2], h, kernel_rows);
      x = x + products(layer.groups[3], at::silu(gate_up[0]) * gate_up[1], kernel_rows)[0];
    }
    return x;
  }

  // Whether a step of `tokens` decode rows runs as one part of its rows per thread
  // (forward_split) rather than all rows together with each call split between the threads.
  // (OpenMP's dynamic adjustment could give the parts, and ATen's calls, fewer threads than
  // get_num_threads() says, which silu_rounds_alike and the parts' serial calls assume.)
  bool splits_rows(int64_t tokens, const std::vector<int64_t>& kernel_rows) const {
    const int64_t threads = at::get_num_threads();
    return rows_independent_ && threads >= 2 && tokens >= min_rows_per_part_ * threads &&
           tokens <= max_split_rows_ && (!splits_need_native_int4_ || kernel_rows[kNativeInt4] == tokens) &&
           !at::in_parallel_region() && !omp_get_dynamic() && silu_rounds_alike(tokens);
  }

  // Whether silu over the step's [tokens, width] gates rounds the same computed per part (one
  // serial call each) as one call over all rows, for every MLP width. That call (ATen's
  // TensorIterator) runs serially up to GRAIN_SIZE elements, else in chunks of
  // ceil(elements / chunks) elements, chunks = min(threads, ceil(elements / GRAIN_SIZE)), each
  // chunk (and each row, for the fused product's strided gates) a loop of whole blocks and a
  // tail. Where widths and chunks are whole blocks, no element takes the tail either way. (Not
  // so for 9 rows of 4896 on two threads: chunks of 22032 elements end mid-block.)
  bool silu_rounds_alike(int64_t tokens) const {
    const int64_t threads = at::get_num_threads();
    for (const int64_t width : mlp_widths_) {
      if (width % kElementwiseBlock != 0) return false;
      const int64_t elements = tokens * width;
      if (elements <= at::internal::GRAIN_SIZE) continue;
      const int64_t chunks = std::min(threads, (elements + at::internal::GRAIN_SIZE - 1) / at::internal::GRAIN_SIZE);
      if ((elements + chunks - 1) / chunks % kElementwiseBlock != 0) return false;
    }
    return true;
  }

  // A step's rows in parts (bounds), one per thread, each part running the whole stack on its
  // own rows with every call inside it serial (ATen's parallel_for runs inline within a
  // parallel region).
  // Why: split call by call, the threads meet ~8 times a layer, and whatever runs between the
  // products (input quantization, norms, rotary, silu, cache writes, allocations) runs on one
  // thread while the other waits: a third of a 16-row step of the default model. Each thread
  // reads all the weights instead of half, which a step of this many rows, arithmetic-bound,
  // can afford. Bitwise the same as one part: every call it makes computes each row from that
  // row alone (splits_rows holds only where they do: the native products below their kernels'
  // row limits, so a part's products take the kernel the whole step's would; the native
  // attention; norms and rotary per row; silu where it rounds alike, silu_rounds_alike).
  at::Tensor forward_split(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, int64_t block_size,
                           const std::vector<int64_t>& kernel_rows, const std::vector<int64_t>& bounds) const {
    // The lengths checked for the whole step before any part runs: a bad one fails the step
    // before either part writes the cache (the attention checks them too, per part, and the
    // block ids, which a part finds bad only after the other part may have written its rows).
    const int64_t longest = block_tables.size(1) * block_size;
    const at::Tensor lens = context_lens.contiguous();
    const int64_t* lengths = lens.data_ptr<int64_t>();
    for (int64_t r = 0; r < lens.size(0); ++r) {
      const int64_t length = lengths[r];
      TORCH_CHECK(length >= 1 && length <= longest, "row ", r, "'s context length ", length, " is outside 1..",
                  longest, " (its block table's)");
    }
    at::Tensor out = at::empty_like(x);
    parallel_with_state(static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t first, int64_t last) {
      for (int64_t part = first; part < last; ++part) {
        const int64_t begin = bounds[part], end = bounds[part + 1];
        // The layout for this part's rows: each kind's kernel takes all of them or none, as for the step.
        std::vector<int64_t> part_kernel_rows(kernel_rows.size());
        for (size_t kind = 0; kind < kernel_rows.size(); ++kind) {
          part_kernel_rows[kind] = kernel_rows[kind] == 0 ? 0 : end - begin;
        }
        // Contiguous once here, not in each layer's calls.
        at::Tensor rows = run_layers(x.slice(0, begin, end), cos.slice(2, begin, end).contiguous(),
                                     sin.slice(2, begin, end).contiguous(),
                                     slot_mapping.slice(0, begin, end).contiguous(), c10::nullopt, c10::nullopt, -1,
                                     block_tables.slice(0, begin, end).contiguous(),
                                     lens.slice(0, begin, end).contiguous(), block_size, part_kernel_rows);
        out.slice(0, begin, end).copy_(rows);
      }
    });
    ++split_steps_;
    return out;
  }

  // Row bounds of one part per thread (at most, and min_rows_per_part_ rows each at least), of
  // about equal work: each row costs its products (the same for every row) plus attention over
  // its context, so one long context among short ones does not leave one thread waiting.
  std::vector<int64_t> part_bounds(const at::Tensor& context_lens) const {
    const at::Tensor lens = context_lens.contiguous();
    const int64_t* len = lens.data_ptr<int64_t>();
    const int64_t rows = lens.size(0);
    const int64_t parts =
        std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / min_rows_per_part_));
    std::vector<double> cumulative(rows + 1, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      // (A length outside the block table fails in the attention; here it only must not
      // unsort the sums.)
      cumulative[r + 1] =
          cumulative[r] + kPositionsPerRowOfProducts + static_cast<double>(std::max<int64_t>(len[r], 0));
    }
    std::vector<int64_t> bounds{0};
    for (int64_t p = 1; p < parts; ++p) {
      const double target = cumulative[rows] * static_cast<double>(p) / static_cast<double>(parts);
      int64_t row = std::lower_bound(cumulative.begin(), cumulative.end(), target) - cumulative.begin();
      // The nearer of the two bounds around the target, at least min_rows_per_part_ rows a part.
      if (row > 0 && target - cumulative[row - 1] < cumulative[row] - target) --row;
      row = std::max(row, bounds.back() + min_rows_per_part_);
      row = std::min(row, rows - min_rows_per_part_ * (parts - p));
      bounds.push_back(row);
    }
    bounds.push_back(rows);
    return bounds;
  }

  static Product make_product(int64_t kind, at::Tensor weight, c10::optional<at::Tensor> scales,
                              c10::optional<at::Tensor> batched, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(kind >= 0 && kind < kProductKinds, "unknown product kind ", kind);
    TORCH_CHECK(!is_int4(kind) || (scales.has_value() && batched.has_value()),
                "a 4-bit product needs its scales and its batched copy");
    return Product{kind, std::move(weight), scales.value_or(at::Tensor()), batched.value_or(at::Tensor()),
                   std::move(bias)};
  }

  // [T, heads, L, head_dim] keys or values of the step's rows: in place, or gathered by slot.
  static at::Tensor context(const at::Tensor& cache, const at::Tensor& flat_slots, int64_t start, int64_t tokens,
                            int64_t length) {
    at::Tensor rows = start >= 0 ? cache.slice(0, start, start + length) : cache.index_select(0, flat_slots);
    return rows.view({tokens, length, cache.size(1), cache.size(2)}).transpose(1, 2);
  }

  // x * cos + rotate_half(x) * sin in one pass, for x [1, heads, T, head_dim] (any strides),
  // into the layout the ATen expression gives for a projection's output (token-major). Each
  // product and the sum are rounded
  // to float32 as there (no fused multiply-add: built with -ffp-contract=off), so the
  // result is bitwise the same, with one call instead of eight.
  at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
    const int64_t heads = x.size(1), tokens = x.size(2), half = head_dim_ / 2;
    at::Tensor out = at::empty({1, tokens, heads, head_dim_}, x.options()).transpose(1, 2);
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    const float* in = x.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const int64_t sh = x.stride(1), st = x.stride(2), sd = x.stride(3);
    const int64_t oh = out.stride(1), ot = out.stride(2), od = out.stride(3);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        const float* row = in + h * sh + t * st;
        float* dst = o + h * oh + t * ot;
        const float* ct = c + t * head_dim_;
        const float* stt = s + t * head_dim_;
        for (int64_t d = 0; d < head_dim_; ++d) {
          const float rotated = d < half ? -row[(d + half) * sd] : row[(d - half) * sd];
          const float a = row[d * sd] * ct[d];
          const float b = rotated * stt[d];
          dst[d * od] = a + b;
        }
      }
    }
    return out;
  }

  // RMSNorm: the native one (rms_norm.cpp) where the model's norms run it; else ATen's, with a
  // batch's rows split between the threads (ATen runs such a small call on one thread), each
  // chunk making the same ATen calls. Bitwise the whole batch's: a norm reduces within a row,
  // and its elementwise ops (square, add, rsqrt as 1 / sqrt, multiplies) round alike on any
  // split. (Not so silu, whose exp is vectorized for whole blocks and scalar for their tails:
  // it is split by rows only where silu_rounds_alike says the blocks fall alike.)
  static at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool native) {
    if (native) return rms_norm(x, weight, eps);
    const int64_t rows = x.size(0), hidden = x.size(1);
    if (rows < kRowsToSplit || at::get_num_threads() < 2) return at::rms_norm(x, {hidden}, weight, eps);
    at::Tensor out = at::empty({rows, hidden}, x.options());
    parallel_with_state(rows, kRowsToSplit / 2, [&](int64_t first, int64_t last) {
      out.slice(0, first, last).copy_(at::rms_norm(x.slice(0, first, last), {hidden}, weight, eps));
    });
    return out;
  }

  // A 4-bit product on its kernel (rows the layout puts there).
  at::Tensor int4(const Product& p, const at::Tensor& x, const at::Tensor& rounded) const {
    if (p.kind == kNativeInt4) return int4_product(x, p.weight, p.scales);
    return at::_weight_int4pack_mm_for_cpu(rounded, p.weight, group_size_, p.scales).to(at::kFloat);
  }

  // A group's products on one input; those taking bfloat16 share one rounded copy. 4-bit
  // products compute the step's rows on their kernel or, where the layout says none, their copy.
  std::vector<at::Tensor> products(const ProductGroup& group, const at::Tensor& x,
                                   const std::vector<int64_t>& kernel_rows) const {
    const int64_t rows = x.size(0);
    const at::Tensor rounded = group.rounds_always || (group.rounds_above && kernel_rows[kNativeInt4] < rows)
                                   ? x.to(at::kBFloat16)
                                   : at::Tensor();
    if (group.fused.has_value() && kernel_rows[group.fused->kind] == rows) {
      const Product& f = *group.fused;
      at::Tensor y = int4(f, x, rounded);
      return (f.bias.has_value() ? y + *f.bias : y).split_with_sizes(group.sizes, 1);
    }
    std::vector<at::Tensor> out;
    out.reserve(group.parts.size());
    for (const Product& p : group.parts) {
      if (p.kind == kPackedFloat32) {
        out.push_back(onednn_linear(x, p.weight, p.bias));
        continue;
      }
      if (p.kind == kNativeFloat32) {
        at::Tensor y = float32_product(x, p.weight);
        // In place, as Float32Linear adds it.
        if (p.bias.has_value()) y += *p.bias;
        out.push_back(y);
        continue;
      }
      at::Tensor y;
      if (is_int4(p.kind) && kernel_rows[p.kind] == rows) {
        y = int4(p, x, rounded);
      } else {
        const at::Tensor& weight = is_int4(p.kind) ? p.batched : p.weight;
        y = onednn_linear(weight.scalar_type() == at::kBFloat16 ? rounded : x, weight, c10::nullopt).to(at::kFloat);
      }
      out.push_back(p.bias.has_value() ? y + *p.bias : y);
    }
    return out;
  }

  bool finished_ = false;
  // Whether every call of a step computes each row from that row alone, and up to how many
  // rows (finish): where forward_split may split steps by rows.
  bool rows_independent_ = false;
  int64_t max_split_rows_ = 0;
  bool splits_need_native_int4_ = false;  // a native 4-bit product: parts need every row on its kernel
  int64_t min_rows_per_part_ = kMinRowsPerPartInt4;  // the kinds' largest kMinRowsPerPart*
  std::vector<int64_t> mlp_widths_;  // the layers' MLP inner widths (silu's), each once
  mutable std::atomic<int64_t> split_steps_{0};

  int64_t head_dim_, group_size_;
  std::vector<Layer> layers_;
};

TORCH_LIBRARY(antiphon_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_group", &DecodeStack::add_group)
      .def("add_product", &DecodeStack::add_product)
      .def("fuse_group", &DecodeStack::fuse_group)
      .def("finish", &DecodeStack::finish)
      .def("num_layers", &DecodeStack::num_layers)
      .def("row_parts", &DecodeStack::row_parts)
      .def("split_steps", &DecodeStack::split_steps)
      .def("forward", &DecodeStack::forward);
  m.def("write_kv_rows(Tensor(a!) cache, Tensor slots, Tensor rows) -> ()", &write_kv_rows);
}
