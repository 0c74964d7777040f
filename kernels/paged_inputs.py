"""The checks both attention kernels make on their inputs, their output buffer, and how
they multiply tiles."""

from __future__ import annotations

import torch


def check_paged_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor) -> int:
    """query [N, Hq, D] against caches [num_slots, Hkv, D]; returns the query group Hq / Hkv.
    The kernels step through the head dimension and table rows with unit stride."""
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} kv heads")
    if key_cache.shape != value_cache.shape or key_cache.shape[2] != head_dim:
        raise ValueError(f"cache shapes {tuple(key_cache.shape)} and {tuple(value_cache.shape)} "
                         f"do not match head_dim {head_dim}")
    if key_cache.stride(2) != 1 or value_cache.stride(2) != 1 or query.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("query and caches need a contiguous head_dim, block tables contiguous rows")
    return num_q_heads // num_kv_heads


def output_for(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` (a view of a larger output the caller owns) when given and fitting, else a new one."""
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not fit the query {tuple(query.shape)} {query.dtype}")
    return out


def operand_options(key_cache: torch.Tensor, widen_operands: bool | None) -> dict:
    """The kernels' WIDEN and DOT_PRECISION. widen_operands: dot in fp32 rather than the
    cache's dtype; None widens only in Triton's interpreter, whose bf16 arithmetic is wrong.
    Tests pass False to run a GPU's operand path through the interpreter for fp16 and fp32
    caches. fp32 caches multiply in IEEE fp32, not tf32 (exactness checks use them)."""
    import triton

    widen = triton.knobs.runtime.interpret if widen_operands is None else widen_operands
    return {"WIDEN": widen, "DOT_PRECISION": "ieee" if key_cache.dtype == torch.float32 else "tf32"}
