// The paged decode attention of decode_attention.cpp, for decode_stack.cpp.
#pragma once

#include <ATen/ATen.h>

// Whether this CPU (AVX-512F) runs it for heads of this size.
bool decode_attention_supported(int64_t head_dim);

// q [rows, heads, head_dim] float32; caches [slots, kv_heads, head_dim]; context_slots
// [rows, length] int64, of which row r's first context_lens[r] are its context -> [rows,
// heads, head_dim].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& context_slots, const at::Tensor& context_lens, double scale);
