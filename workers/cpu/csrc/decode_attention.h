// The paged decode attention of decode_attention.cpp, for decode_stack.cpp.
#pragma once

#include <ATen/ATen.h>

// Whether this CPU (AVX-512F) runs it for heads of this size.
bool decode_attention_supported(int64_t head_dim);

// q [rows, heads, head_dim] float32; caches [blocks * block_size, kv_heads, head_dim];
// block_tables [rows, width] int64, row r's context being its first context_lens[r] positions
// (position j in slot block_tables[r][j / block_size] * block_size + j % block_size) ->
// [rows, heads, head_dim].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double scale);
