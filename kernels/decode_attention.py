"""Attention of one new query token per row over a paged KV cache, in Triton (split-K decode).

What it computes: row b's query (all num_q_heads heads) attends with softmax(scale * q.k) to
the keys and values at positions 0..context_lens[b]-1, read through block_tables[b]: position
j lives in slot block_tables[b, j // block_size] * block_size + j % block_size of key_cache /
value_cache ([num_slots, num_kv_heads, head_dim]). Query head h reads kv head h // G
(grouped-query attention, G = num_q_heads // num_kv_heads). A row with no context (the padded
rows of a CUDA-graph batch) gets zeros. The result has the query's dtype; sums are in fp32.

How it is tiled, and why:
- Stage 1, grid (B, num_kv_heads, num_splits): one program takes the G query heads of one kv
  head as the M rows of its dots (padded to BLOCK_G >= 16, the smallest tensor-core tile), so
  each key and value tile is loaded once for the whole group. Split i of a row covers
  positions [i * L, (i + 1) * L) with L = cdiv(context_len, num_splits) rounded up to BLOCK_N:
  every row spreads its own context over all its splits, whatever the longest row, and a
  split that starts past the context is empty.
- Keys are tiled by token position (BLOCK_N >= 16, independent of block_size): each tile
  gathers its BLOCK_N block ids from the block table and computes per-token slots, so any
  block size works. Tiles wholly inside the context run without masks; only the one holding
  the context's end is masked, so block-table entries past a context (garbage, -1, stale ids)
  are never read. Online softmax in base 2 (scale folded into log2(e)).
- Each split writes its unnormalised fp32 accumulator, running max and running sum to a
  workspace (an empty split writes max -inf and sum 0 and nothing else). Stage 2, grid
  (B, num_q_heads), combines a head's splits in one shot with the log-sum-exp rule, reading
  accumulators only of non-empty splits. With num_splits == 1, stage 1 normalises and writes
  the output itself and stage 2 is not launched.
- head_dim is padded to a power of two >= 16 with masked loads.

No launch decision reads a tensor's value (the grid, the split count and the tiles come from
shapes and Python ints), so a decode step can be captured in a CUDA graph. The batch size is
only a grid dimension: a new batch size reuses the compiled kernels.

Dot operands stay in the cache's dtype on a GPU (bf16/fp16 tensor cores, fp32 accumulation; an
fp32 cache uses exact "ieee" dots rather than tf32). Triton's CPU interpreter computes bf16
wrongly, so there every tile is widened to fp32 right after its load (WIDEN).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.online_softmax import online_softmax_step
from kernels.paged_inputs import check_paged_inputs, operand_options, output_for

# Split-K heuristic (choose_num_splits). A split shorter than this many positions costs more
# in its workspace round trip and reduction than it saves.
POSITIONS_PER_SPLIT = 256
# More splits than this only add reduction work: a single row of a model with 8 kv heads
# already makes 512 programs, about four per SM of an H100 (132 SMs).
MAX_SPLITS = 64
# Stage-1 programs wanted per SM: a decode is bound by memory latency, and several resident
# programs per SM keep enough loads in flight to stream the cache at full bandwidth.
PROGRAMS_PER_SM = 4
# Off CUDA (Triton's interpreter) there is no device to ask; an H100's count keeps the choice
# the same as it would be on the GPU the code is written for.
DEFAULT_SM_COUNT = 132


@dataclass(frozen=True)
class DecodeTiles:
    block_n: int  # key positions per inner iteration, a power of two >= 16
    num_warps: int
    num_stages: int


@functools.cache
def choose_tiles(head_dim: int, element_size: int) -> DecodeTiles:
    """Positions per tile: 64 for 16-bit caches with heads up to 128 wide, 32 for wider ones.
    An fp32 cache dots on CUDA cores ("ieee", no tensor cores), whose operands live in
    registers: 32 positions for heads up to 64, 16 above. Larger tiles spill registers on
    sm_90 (ptxas -v of the compiled kernels); these use at most ~120 at 4 warps, so four
    programs fit on an SM."""
    head_pad = max(16, triton.next_power_of_2(head_dim))
    if element_size <= 2:
        block_n = 64 if head_pad <= 128 else 32
    else:
        block_n = 32 if head_pad <= 64 else 16
    return DecodeTiles(block_n=block_n, num_warps=4, num_stages=2)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, sm_count: int) -> int:
    """Splits per row, from shapes only (the values of context_lens are never read on the host).

    max_context_len is the longest context the block tables can describe (columns x block_size):
    a split count that serves it also serves every shorter row, whose context the kernel spreads
    over the same splits. Two limits, the smaller wins:
    - length: at least POSITIONS_PER_SPLIT positions per split of the longest possible row;
    - occupancy: enough (row, kv head, split) programs for PROGRAMS_PER_SM per SM. A large batch
      fills the GPU with rows alone and takes one split (no workspace, no second launch); a
      single long stream takes many.
    Capped at MAX_SPLITS.
    """
    by_length = triton.cdiv(max(max_context_len, 1), POSITIONS_PER_SPLIT)
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * sm_count, max(batch * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, block_size: int,
                           num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, Hq, D]; caches [num_slots, Hkv, D]; block_tables int32 [B, max_blocks];
    context_lens int32 [B] -> [B, Hq, D] in the query's dtype, written into `out` when given.

    num_splits None picks it from shapes (choose_num_splits). Makes no host synchronisation.
    """
    tiles = choose_tiles(query.shape[2], key_cache.element_size())
    if num_splits is None:
        num_splits = choose_num_splits(query.shape[0], key_cache.shape[1], block_tables.shape[1] * block_size,
                                       device_sm_count(query.device))
    return paged_decode_attention_tiled(query, key_cache, value_cache, block_tables, context_lens, scale,
                                        block_size, num_splits, tiles, out=out)


def allocate_partials(batch: int, num_q_heads: int, num_splits: int, head_dim: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's workspace: accumulators [B, Hq, S, D], running maxima and sums [B, Hq, S], fp32.

    Left uninitialised: stage 2 reads only what stage 1 wrote (tests fill it with NaN to check).
    """
    acc = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    running_max = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device)
    running_sum = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device)
    return acc, running_max, running_sum


def paged_decode_attention_tiled(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                 block_size: int, num_splits: int, tiles: DecodeTiles,
                                 widen_operands: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode_attention with the split count and tile shape given (tests force them);
    widen_operands: see paged_inputs.operand_options."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = check_paged_inputs(query, key_cache, value_cache, block_tables)
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block tables {tuple(block_tables.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} do not have {batch} rows")
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    out = output_for(query, out)
    if batch == 0:
        return out
    head_pad = max(16, triton.next_power_of_2(head_dim))
    single = num_splits == 1
    if single:
        # Stage 1 writes the output directly; these stand in for the unused workspace.
        part_acc, part_max, part_sum = out, out, out
        part_strides = (0, 0, 0, 0, 0)
    else:
        part_acc, part_max, part_sum = allocate_partials(batch, num_q_heads, num_splits, head_dim, query.device)
        part_strides = (part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
                        part_max.stride(0), part_max.stride(1))
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, context_lens, out, part_acc, part_max, part_sum,
        scale * 1.4426950408889634,  # log2(e): the softmax runs on exp2
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        value_cache.stride(0), value_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *part_strides,
        GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=tiles.block_n, SINGLE_SPLIT=single,
        **operand_options(key_cache, widen_operands),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if not single:
        _combine_splits_kernel[(batch, num_q_heads)](
            part_acc, part_max, part_sum, out, num_splits,
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_max.stride(0), part_max.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
            # One [splits, head_dim] fp32 tile per program: at most 64 elements per thread.
            num_warps=max(1, min(8, triton.next_power_of_2(num_splits) * head_pad // 2048)),
        )
    return out


@triton.jit
def _attend_key_tiles(acc, m_i, l_i, q, k_base, v_base, block_table_row, stride_ks, stride_vs,
                      offs_d, d_mask, key_start, key_end, context_len, qk_scale,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      WIDEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(key_start, key_end, BLOCK_N):
        pos = start + offs_n
        if MASKED:
            key_mask = pos < context_len
            block_ids = tl.load(block_table_row + pos // BLOCK_SIZE, mask=key_mask, other=0)
            k_mask = d_mask[:, None] & key_mask[None, :]
            v_mask = key_mask[:, None] & d_mask[None, :]
        else:
            block_ids = tl.load(block_table_row + pos // BLOCK_SIZE)
            k_mask = d_mask[:, None]
            v_mask = d_mask[None, :]
        # Block ids times block_size times the slot stride overflow int32 in a large cache.
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        k = tl.load(k_base + slots[None, :] * stride_ks + offs_d[:, None], mask=k_mask, other=0.0)
        if WIDEN:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            qk = tl.where(key_mask[None, :], qk, float("-inf"))
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=v_mask, other=0.0)
        if WIDEN:
            v = v.to(tl.float32)
        # The first tile of a split always holds a position of the context, so the running max is finite
        # from there on and masked positions give exp2(-inf) = 0, never NaN.
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, qk, v, DOT_PRECISION)
    return acc, m_i, l_i


# The block-table width changes with the batch on the eager path; specialising on it (== 1, a
# multiple of 16) would compile new variants mid-serving for no gain.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_ob, stride_oh,
    stride_pab, stride_pah, stride_pas, stride_pmb, stride_pmh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    WIDEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + row)
    split_len = tl.cdiv(tl.cdiv(context_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM

    if not SINGLE_SPLIT:
        part_stats = row * stride_pmb + head * stride_pmh + split
        if split_start >= context_len:
            # An empty partial: stage 2 gives it weight 0 and never reads its accumulator.
            tl.store(part_max_ptr + part_stats, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g_mask)
            tl.store(part_sum_ptr + part_stats, tl.zeros([BLOCK_G], tl.float32), mask=g_mask)
            return

    q = tl.load(query_ptr + row * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)
    else:
        # Both dot operands in the cache's dtype, whatever the query's.
        q = q.to(key_cache_ptr.dtype.element_ty)

    block_table_row = block_tables_ptr + row * stride_bt
    k_base = key_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = value_cache_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_PAD], dtype=tl.float32)

    # Split boundaries are multiples of BLOCK_N, so at most the tile holding the context's end
    # needs masks.
    full_end = tl.maximum(tl.minimum(split_end, context_len // BLOCK_N * BLOCK_N), split_start)
    acc, m_i, l_i = _attend_key_tiles(acc, m_i, l_i, q, k_base, v_base, block_table_row, stride_ks, stride_vs,
                                      offs_d, d_mask, split_start, full_end, context_len, qk_scale,
                                      BLOCK_SIZE, BLOCK_N, False, WIDEN, DOT_PRECISION)
    acc, m_i, l_i = _attend_key_tiles(acc, m_i, l_i, q, k_base, v_base, block_table_row, stride_ks, stride_vs,
                                      offs_d, d_mask, full_end, split_end, context_len, qk_scale,
                                      BLOCK_SIZE, BLOCK_N, True, WIDEN, DOT_PRECISION)

    if SINGLE_SPLIT:
        # A row with no context has l_i = 0 and acc = 0: its output is zeros, not 0 / 0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        tl.store(part_max_ptr + part_stats, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part_stats, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row * stride_pab + head[:, None] * stride_pah + split * stride_pas + offs_d[None, :],
                 acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_splits,
    stride_pab, stride_pah, stride_pas, stride_pmb, stride_pmh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM
    stats = row * stride_pmb + head * stride_pmh + offs_s
    s_mask = offs_s < num_splits
    m = tl.load(part_max_ptr + stats, mask=s_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + stats, mask=s_mask, other=0.0)
    # Splits share the row's max; a row whose splits are all empty (no context) keeps 0, so
    # exp2(-inf - 0) = 0 everywhere rather than exp2(-inf + inf) = NaN.
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_max)
    total = tl.sum(l * weight, axis=0)
    # An empty split's accumulator was never written: mask it out rather than multiply by 0.
    live = s_mask & (l > 0)
    acc = tl.load(part_acc_ptr + row * stride_pab + head * stride_pah + offs_s[:, None] * stride_pas + offs_d[None, :],
                  mask=live[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                     block_size: int, num_splits: int | None = None) -> torch.Tensor:
    """The specification in plain torch, one row at a time (syncs with the host; tests only).

    num_splits only changes how the kernel sums, never what: it is ignored here.
    """
    out = torch.zeros_like(query)
    group = query.shape[1] // key_cache.shape[1]
    for r, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        positions = torch.arange(context_len, device=query.device)
        slots = block_tables[r, positions // block_size].long() * block_size + positions % block_size
        k = key_cache[slots].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = value_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", query[r].float(), k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[r] = torch.einsum("hk,khd->hd", probs, v).to(query.dtype)
    return out
