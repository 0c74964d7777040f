"""The step's new keys and values into their paged-cache slots, in Triton (reshape_and_cache).

What it computes: for every token t with slot_mapping[t] >= 0, key_cache[slot] = key[t] and
value_cache[slot] = value[t] (all heads), converted to the cache's dtype; tokens whose slot is
negative (the padded rows of a CUDA-graph batch) write nothing.

How it is tiled: one program per token and block of heads, moving a [BLOCK_H, HEAD_PAD] tile of
the key and the same of the value. head_dim is padded to a power of two with masked loads; the
head block is capped at 4096 elements so very wide layers take a second grid column rather than
spilling registers. One launch writes both caches, whatever the number of tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of one tile (key or value) per program: 32 per thread at 4 warps.
_MAX_TILE_ELEMENTS = 4096


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """key, value [T, num_kv_heads, head_dim] (any float dtype, any row and head strides);
    caches [num_slots, num_kv_heads, head_dim]; slot_mapping [T] int32 or int64, negative: skip.

    Makes no host synchronisation: the skip is decided on the device.
    """
    num_tokens, num_heads, head_dim = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not describe the same tokens")
    if key_cache.shape[1:] != key.shape[1:] or value_cache.shape != key_cache.shape:
        raise ValueError(f"caches {tuple(key_cache.shape)} and {tuple(value_cache.shape)} do not hold "
                         f"{num_heads} heads of {head_dim}")
    if key.stride(2) != 1 or value.stride(2) != 1 or key_cache.stride(2) != 1 or value_cache.stride(2) != 1:
        raise ValueError("keys, values and caches need a contiguous head_dim")
    if num_tokens == 0:
        return
    head_pad = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _MAX_TILE_ELEMENTS // head_pad))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _write_kv_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_H=block_h,
        num_warps=max(1, min(4, block_h * head_pad // 512)),
    )


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # Slots times the row stride overflow int32 in a cache of a few million slots.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]

    key = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(key_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
             key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(value_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
             value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The specification in plain torch (its boolean indexing syncs with the host; tests only)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache[slots] = key[keep].to(key_cache.dtype)
    value_cache[slots] = value[keep].to(value_cache.dtype)
