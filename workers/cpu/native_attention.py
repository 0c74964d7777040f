"""Whether a CPU model's decode steps attend with the native kernel, which reads each row's
context from the paged KV cache in place (workers/cpu/csrc/decode_attention.cpp), instead of
gathering it and running SDPA over the padded batch (paged_attention.decode_attention).

Per layer it is 1.8-8x faster than gather + SDPA (`python benchmarks/decode_attention.py`),
float32 throughout, within float32 rounding of SDPA but not bitwise SDPA's. It serves the
models whose layers run a native product, 4-bit (int4.py) or exact mode's float32
(float32_linear.py): those waited for the library when they loaded, so their attention
computes the same way from the first step to the last. (bf16 and int8 models start serving
before the library is built; switching kernels under a running request would move its
numbers mid-answer.) Exact mode's claim, greedy tokens equal to transformers', holds with it:
the test suite runs in exact mode.
"""

from __future__ import annotations

import torch

from workers.cpu import native_library


def serves(model: torch.nn.Module, head_dim: int) -> bool:
    if not native_library.takes_native_kernels(model):
        return False
    return bool(torch.ops.antiphon_cpu.decode_attention_supported(head_dim))


def attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """q [B, Hq, D]; caches [blocks * block_size, Hkv, D]; block_tables [B, W] int64, row b's
    context being its first context_lens[b] positions -> [B, Hq, D]."""
    return torch.ops.antiphon_cpu.decode_attention(q, key_cache, value_cache, block_tables, context_lens, block_size,
                                                   scale)
