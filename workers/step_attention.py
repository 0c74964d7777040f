"""The attention layers' view of one step, built from its plan (batch_planning.PackedBatch).

The two attention backends read the paged KV cache differently (workers/paged_attention.py),
so a step's metadata takes one of two shapes:
- the Triton kernels (CUDA) read block tables: BlockTableMetadata, the single-token rows first
  and the prefill chunks packed after them, with nothing read back on the host, so that a
  decode step can be captured in a CUDA graph;
- the torch path (CPU) attends with SDPA over gathered contexts: PagedAttentionMetadata,
  decodes in groups of similar context lengths (or, where the native decode attention serves,
  one group reading the block tables in place), prefill chunks one span each.
Both are built here from the plan and the cache they read, so the runner's forward holds
neither backend's layout rules; the runner sets the result in the step's forward context.
"""

from __future__ import annotations

import numpy as np
import torch

from workers.batch_planning import PackedBatch
from workers.host_staging import HostToDevice
from workers.paged_attention import BlockTableMetadata, DecodeGroup, PagedAttentionMetadata, PrefillSpan

# Decodes whose context is shorter than this fraction of a group's longest start a new
# group: fewer padded keys to read, at the cost of one more attention call per layer.
DECODE_GROUP_MIN_FILL = 0.5

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def attention_metadata(batch: PackedBatch, kv_caches: KVCaches, block_size: int, to_device: HostToDevice, *,
                       use_kernels: bool, native_attention: bool) -> BlockTableMetadata | PagedAttentionMetadata:
    """The layers' view of the step, on the device (the step's arrays go through `to_device`).
    `use_kernels`: the Triton backend; `native_attention`: on the torch path, decodes attend
    with the native CPU kernel (workers/cpu/native_attention.py)."""
    slot_mapping = to_device("slot_mapping", batch.slot_mapping)
    max_context_len = int(batch.ends.max())
    if use_kernels:
        return _block_table_metadata(batch, slot_mapping, kv_caches, block_size, to_device, max_context_len)
    return _paged_attention_metadata(batch, slot_mapping, kv_caches, block_size, to_device.device,
                                     native_attention, max_context_len)


def _block_table_metadata(batch: PackedBatch, slot_mapping: torch.Tensor, kv_caches: KVCaches, block_size: int,
                          to_device: HostToDevice, max_context_len: int) -> BlockTableMetadata:
    """The Triton path: one decode launch for the leading single-token rows, one prefill
    launch for the chunks after them (query_start_loc delimits each chunk)."""
    d = batch.num_decodes
    chunk_lens = batch.counts[d:]
    return BlockTableMetadata(
        slot_mapping=slot_mapping, kv_caches=kv_caches,
        block_tables=to_device("block_tables", batch.block_tables),
        context_lens=to_device("context_lens", batch.ends.astype(np.int32)),
        block_size=block_size, num_decodes=d,
        prefill_query_start_loc=(to_device("query_start_loc", np.concatenate(
            ([0], np.cumsum(chunk_lens))).astype(np.int32)) if len(chunk_lens) else None),
        max_prefill_query_len=int(chunk_lens.max()) if len(chunk_lens) else 0,
        max_context_len=max_context_len)


def _paged_attention_metadata(batch: PackedBatch, slot_mapping: torch.Tensor, kv_caches: KVCaches,
                              block_size: int, device: torch.device, native_attention: bool,
                              max_context_len: int) -> PagedAttentionMetadata:
    """The CPU path: decodes in groups of similar context lengths, each context gathered by
    slot (or, for the native decode attention, in one group reading the block tables in
    place), prefill chunks one span each."""
    bs, table, counts, ends = block_size, batch.block_tables, batch.counts, batch.ends
    num_rows = len(counts)
    decode_rows = np.nonzero(counts == 1)[0]
    # The native kernel reads each row's own length, so rows of any lengths share a group.
    one_group = native_attention and len(decode_rows) > 0
    row_groups = [decode_rows] if one_group else _group_by_length(decode_rows, ends)
    all_decodes_in_order = len(row_groups) == 1 and len(decode_rows) == num_rows
    if all_decodes_in_order:
        row_groups = [decode_rows]  # batch order: the attention output needs no scatter
    decode_groups = [_decode_group(table, ends, batch.query_offsets, rows, bs, device, native_attention)
                     for rows in row_groups]
    prefill_spans = []
    for row in np.nonzero(counts > 1)[0].tolist():
        start, end, q0 = int(batch.starts[row]), int(ends[row]), int(batch.query_offsets[row])
        span = PrefillSpan(q0, q0 + end - start)
        if start > 0:
            ctx = np.arange(end)
            span.context_slots = torch.from_numpy(table[row, ctx // bs] * bs + ctx % bs).to(device)
            span.causal_mask = (torch.arange(end).unsqueeze(0)
                                <= torch.arange(start, end).unsqueeze(1)).to(device)
        prefill_spans.append(span)
    return PagedAttentionMetadata(slot_mapping, decode_groups, prefill_spans, kv_caches, max_context_len,
                                  all_decodes_in_order=all_decodes_in_order)


def _decode_group(table: np.ndarray, ends: np.ndarray, query_offsets: np.ndarray, rows: np.ndarray,
                  block_size: int, device: torch.device, native_attention: bool) -> DecodeGroup:
    bs = block_size
    lengths = ends[rows]
    if native_attention:
        # Its block tables as they are (their padding past a row's length is never read).
        return DecodeGroup(query_index=torch.from_numpy(query_offsets[rows]),
                           block_tables=torch.from_numpy(table[rows]), block_size=bs,
                           context_lens=torch.from_numpy(lengths.astype(np.int64)))
    ctx = np.arange(int(lengths.max()))
    slots = table[rows][:, ctx // bs] * bs + ctx % bs
    # Rows of one length (one stream, say) pad nothing: no mask, which SDPA runs faster
    # (44 vs 61 us per layer for one row of 300 tokens here) with bitwise the same output.
    mask = None
    if lengths.min() != lengths.max():
        mask = torch.from_numpy(ctx[None, :] < lengths[:, None])[:, None, None, :].to(device)
    # One row on consecutive blocks (a stream whose blocks came off the free list in
    # order) is read from the cache in place: no gather, ~30 us less per layer here.
    context_start = None
    num_blocks = -(-len(ctx) // bs)
    if len(rows) == 1 and (np.diff(table[rows[0], :num_blocks]) == 1).all():
        context_start = int(slots[0, 0])
    return DecodeGroup(
        query_index=torch.from_numpy(query_offsets[rows]).to(device),
        context_slots=torch.from_numpy(slots).to(device),
        context_mask=mask,
        context_start=context_start,
    )


def _group_by_length(rows: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """`rows` by descending length, cut where a row falls below DECODE_GROUP_MIN_FILL of its
    group's longest (stable: rows of one length keep their batch order)."""
    if len(rows) == 0:
        return []
    ordered = rows[np.argsort(-lengths[rows], kind="stable")]
    groups, current, longest = [], [], 0
    for row in ordered.tolist():
        if current and lengths[row] < DECODE_GROUP_MIN_FILL * longest:
            groups.append(np.asarray(current))
            current = []
        if not current:
            longest = lengths[row]
        current.append(row)
    groups.append(np.asarray(current))
    return groups
