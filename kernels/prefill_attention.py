"""Causal attention of a packed batch of prefill chunks over a paged KV cache, in Triton.

What it computes: request r of the batch owns query rows query_start_loc[r]:query_start_loc[r+1]
(q_len of them) and has context_lens[r] tokens after this step, the chunk's own keys and values
already written to the cache. Query i of r sits at position p = context_lens[r] - q_len + i and
attends with softmax(scale * q.k) to the keys and values at positions 0..p, read through
block_tables[r]: position j lives in slot block_tables[r, j // block_size] * block_size
+ j % block_size of key_cache / value_cache ([num_slots, num_kv_heads, head_dim]). Query head h
reads kv head h // G (grouped-query attention, G = num_q_heads // num_kv_heads). The result has
the query's dtype; every sum is taken in fp32.

How it is tiled, and why:
- One program computes BLOCK_Q consecutive query tokens of one request for all G query heads of
  one kv head: its M rows are token-major (row m is token m // G, head m % G), so every key and
  value tile it loads serves the whole group, and a small q_len (decode rows in a mixed batch)
  still fills the M >= 16 rows a tensor-core dot needs once G is large.
- One launch covers the whole ragged batch without a host-side index: request r's query tiles
  are numbered from query_start_loc[r] // BLOCK_Q + r, which leaves each request at least
  cdiv(q_len, BLOCK_Q) tiles, so T // BLOCK_Q + R programs per kv head cover every request. A
  program finds its request by binary search over query_start_loc and exits if its tile lies
  past its request's q_len (at most one such tile per request). Programs run in reverse order,
  so the tiles that see the longest contexts (the ends of the longest chunks) start first and
  the short ones fill in behind them.
- Keys are tiled by token position (BLOCK_N >= 16, independent of block_size): each tile gathers
  its BLOCK_N block ids from the block table and computes per-token slots, so any block size
  works, and ids past the context (garbage, -1, stale) are never read. Flash-attention online
  softmax (base 2, scale folded into log2(e)) runs first over the key tiles every query row of
  the tile sees in full, with no masks, then over the few tiles on the causal diagonal with the
  causal mask; tiles wholly past the tile's last query position are never visited.
- head_dim is padded to a power of two >= 16 with masked loads.

Dot operands stay in the cache's dtype on a GPU (bf16/fp16 tensor cores, fp32 accumulation; an
fp32 cache uses exact "ieee" dots rather than tf32). Triton's CPU interpreter computes bf16
wrongly, so there every tile is widened to fp32 right after its load (WIDEN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.online_softmax import online_softmax_step
from kernels.paged_inputs import check_paged_inputs, operand_options, output_for


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # rows per program: query tokens x G, a power of two >= 16
    block_n: int  # key positions per inner iteration, a power of two >= 16
    num_warps: int
    num_stages: int


def choose_tiles(max_query_len: int, group: int, head_dim: int, element_size: int) -> PrefillTiles:
    """Tile sizes for a batch whose longest chunk has max_query_len tokens.

    128 rows x 64 keys is the usual flash-attention shape on Hopper and Ampere for head_dim
    <= 128; a batch of short chunks (or decode rows) takes fewer rows so that most of the tile
    is real work. Wide heads and fp32 caches take smaller tiles to stay within registers and
    shared memory.
    """
    head_pad = max(16, triton.next_power_of_2(head_dim))
    rows = max(max_query_len, 1) * group
    block_m = 16 if rows <= 16 else 64 if rows <= 64 else 128
    if head_pad >= 256 or element_size > 2:
        block_m = min(block_m, 64)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_n = 64 if head_pad <= 128 and element_size <= 2 else 32
    num_warps = 8 if block_m >= 128 or head_pad >= 256 else 4
    num_stages = 3 if element_size <= 2 and head_pad <= 128 else 2
    return PrefillTiles(block_m, block_n, num_warps, num_stages)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            max_query_len: int, scale: float, block_size: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D]; caches [num_slots, Hkv, D]; block_tables int32 [R, max_blocks];
    query_start_loc int32 [R + 1]; context_lens int32 [R] -> [T, Hq, D] in the query's dtype,
    written into `out` when given (a view of a larger output: no copy afterwards).

    Makes no host synchronisation; max_query_len (a host int) only picks the tile shape.
    """
    group = query.shape[1] // key_cache.shape[1]
    tiles = choose_tiles(max_query_len, group, query.shape[2], key_cache.element_size())
    return paged_prefill_attention_tiled(query, key_cache, value_cache, block_tables, query_start_loc,
                                         context_lens, scale, block_size, tiles, out=out)


def paged_prefill_attention_tiled(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                  block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                  context_lens: torch.Tensor, scale: float, block_size: int,
                                  tiles: PrefillTiles, widen_operands: bool | None = None,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_prefill_attention with the tile shape given (tests use it to force small tiles);
    widen_operands: see paged_inputs.operand_options."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = check_paged_inputs(query, key_cache, value_cache, block_tables)
    if tiles.block_m < group:
        raise ValueError(f"block_m {tiles.block_m} is smaller than the query group {group}")
    out = output_for(query, out)
    num_requests = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_requests == 0:
        return out
    block_q = tiles.block_m // group
    grid = (num_tokens // block_q + num_requests, num_kv_heads)
    _prefill_attention_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens, out,
        scale * 1.4426950408889634,  # log2(e): the softmax runs on exp2
        num_requests,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        value_cache.stride(0), value_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=tiles.block_m, BLOCK_Q=block_q, BLOCK_N=tiles.block_n,
        **operand_options(key_cache, widen_operands),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
    # The last request r whose first tile (query_start_loc[r] // BLOCK_Q + r) is <= tile.
    lo: tl.int32 = 0
    hi: tl.int32 = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_key_tiles(acc, m_i, l_i, q, q_pos, k_base, v_base, block_table_row, stride_ks, stride_vs,
                      offs_d, d_mask, key_start, key_end, last_pos, qk_scale,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                      WIDEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(key_start, key_end, BLOCK_N):
        pos = start + offs_n
        if CAUSAL:
            # Diagonal tiles run past the last query position, where the block table holds
            # whatever the allocator left there.
            key_mask = pos <= last_pos
            block_ids = tl.load(block_table_row + pos // BLOCK_SIZE, mask=key_mask, other=0)
        else:
            key_mask = None
            block_ids = tl.load(block_table_row + pos // BLOCK_SIZE)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        if CAUSAL:
            k_mask = d_mask[:, None] & key_mask[None, :]
            v_mask = key_mask[:, None] & d_mask[None, :]
        else:
            k_mask = d_mask[:, None]
            v_mask = d_mask[None, :]
        k = tl.load(k_base + slots[None, :] * stride_ks + offs_d[:, None], mask=k_mask, other=0.0)
        if WIDEN:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL:
            qk = tl.where(pos[None, :] <= q_pos[:, None], qk, float("-inf"))
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=v_mask, other=0.0)
        if WIDEN:
            v = v.to(tl.float32)
        # Every row sees position 0 in the first tile, so the running max is finite from there on and
        # fully masked rows of a later tile give exp2(-inf) = 0, never NaN.
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, qk, v, DOT_PRECISION)
    return acc, m_i, l_i


# Triton compiles a variant per integer equal to 1 or divisible by 16 and per pointer alignment:
# the request count, the block-table width and the row offset of the engine's slices of the
# tables (the prefill rows follow the decodes) change every step, and a recompile mid-serving
# stalls the GPU for seconds.
@triton.jit(do_not_specialize=["num_requests", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr"])
def _prefill_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr, out_ptr,
    qk_scale, num_requests,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    WIDEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    request = _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + request)
    q_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    first_q = (tile - (query_start // BLOCK_Q + request)) * BLOCK_Q
    if first_q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + request)
    prefix_len = context_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM
    token = first_q + offs_m // GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (token < q_len)
    head = kv_head * GROUP + offs_m % GROUP
    q_pos = prefix_len + token

    q_rows = (query_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(query_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    else:
        # Both dot operands in the cache's dtype, whatever the query's.
        q = q.to(key_cache_ptr.dtype.element_ty)

    block_table_row = block_tables_ptr + request.to(tl.int64) * stride_bt
    k_base = key_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = value_cache_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    first_pos = prefix_len + first_q
    last_pos = prefix_len + tl.minimum(first_q + BLOCK_Q, q_len) - 1
    # Key tiles that end at or before the tile's first query position are seen in full by every row.
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_key_tiles(acc, m_i, l_i, q, q_pos, k_base, v_base, block_table_row, stride_ks,
                                      stride_vs, offs_d, d_mask, 0, full_end, last_pos, qk_scale,
                                      BLOCK_SIZE, BLOCK_N, False, WIDEN, DOT_PRECISION)
    acc, m_i, l_i = _attend_key_tiles(acc, m_i, l_i, q, q_pos, k_base, v_base, block_table_row, stride_ks,
                                      stride_vs, offs_d, d_mask, full_end, last_pos + 1, last_pos, qk_scale,
                                      BLOCK_SIZE, BLOCK_N, True, WIDEN, DOT_PRECISION)

    out = acc / l_i[:, None]
    o_rows = (query_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                      context_lens: torch.Tensor, max_query_len: int, scale: float,
                                      block_size: int) -> torch.Tensor:
    """The specification in plain torch, one request at a time (syncs with the host; tests only)."""
    out = torch.empty_like(query)
    num_kv_heads = key_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for r, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        assert q_len <= max_query_len and q_len <= context_len
        positions = torch.arange(context_len, device=query.device)
        block_ids = block_tables[r, positions // block_size].long()
        slots = block_ids * block_size + positions % block_size
        k = key_cache[slots].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = value_cache[slots].float().repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        query_pos = context_len - q_len + torch.arange(q_len, device=query.device)
        visible = positions[None, :] <= query_pos[:, None]  # [q_len, ctx]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
