"""The Triton prefill kernel against its torch specification, in Triton's CPU interpreter.

Every batch is built so that reading anything outside a request's context shows: cache slots
no context covers hold NaN (a stray value read turns the output NaN through the P.V dot), and
block-table entries past a context hold -1, a huge id or the id of a NaN block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels.prefill_attention import (
    PrefillTiles,
    choose_tiles,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    paged_prefill_attention_tiled,
)
from tests.paged_cache_cases import HUGE_BLOCK_ID, TOLERANCES, scattered_cache



@dataclass
class PackedBatch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    max_query_len: int
    scale: float
    block_size: int

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.query_start_loc,
                self.context_lens, self.max_query_len, self.scale, self.block_size)


def make_batch(q_lens: list[int], prefix_lens: list[int], *, num_kv_heads: int = 2, group: int = 1,
               head_dim: int = 64, block_size: int = 4, dtype: torch.dtype = torch.float32,
               shared_blocks: int = 0, seed: int = 0) -> PackedBatch:
    """Requests with the given chunk and cached-prefix lengths, their blocks scattered over a
    larger cache in shuffled order. With shared_blocks, every request's first blocks are
    request 0's (a cached prefix shared by all of them)."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [q + p for q, p in zip(q_lens, prefix_lens, strict=True)]
    key_cache, value_cache, block_tables = scattered_cache(
        context_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        shared_blocks=shared_blocks, extra_columns=3, gen=gen)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PackedBatch(query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), block_tables, query_start_loc,
                       torch.tensor(context_lens, dtype=torch.int32), max(q_lens), head_dim**-0.5, block_size)


def naive_attention(batch: PackedBatch) -> torch.Tensor:
    """One query, one head, one position at a time, with Python-int block-table lookups."""
    query, key_cache, value_cache = batch.query.double(), batch.key_cache.double(), batch.value_cache.double()
    group = query.shape[1] // key_cache.shape[1]
    out = torch.zeros_like(query)
    starts = batch.query_start_loc.tolist()
    for r, context_len in enumerate(batch.context_lens.tolist()):
        q_len = starts[r + 1] - starts[r]
        for i in range(q_len):
            position = context_len - q_len + i
            slots = [int(batch.block_tables[r, j // batch.block_size]) * batch.block_size + j % batch.block_size
                     for j in range(position + 1)]
            for h in range(query.shape[1]):
                q = query[starts[r] + i, h]
                scores = [float(q @ key_cache[s, h // group]) * batch.scale for s in slots]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                out[starts[r] + i, h] = sum(w / total * value_cache[s, h // group] for w, s in zip(weights, slots))
    return out


def assert_matches_reference(batch: PackedBatch, out: torch.Tensor, **tolerance) -> None:
    expected = paged_prefill_attention_reference(*batch.args())
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert torch.isfinite(out).all(), "the kernel read a slot outside some context"
    torch.testing.assert_close(out, expected, **(tolerance or TOLERANCES[batch.query.dtype]))


@pytest.mark.parametrize("group", [1, 3])
def test_reference_matches_naive_per_query_loop(group):
    batch = make_batch([1, 5, 7], [9, 0, 6], group=group, head_dim=16, block_size=4, shared_blocks=1)
    expected = naive_attention(batch)
    torch.testing.assert_close(paged_prefill_attention_reference(*batch.args()), expected.float(),
                               atol=1e-5, rtol=1e-5)


# (q_lens, prefix_lens, group, head_dim, block_size, dtype): every case packs several requests in
# one launch; prefix + q_len often ends mid-block.
KERNEL_CASES = [
    ([1, 5, 17], [30, 0, 9], 1, 64, 4, torch.float32),
    ([1, 5, 17], [30, 0, 9], 4, 64, 16, torch.float16),
    ([1, 5, 17], [30, 0, 9], 8, 128, 4, torch.bfloat16),
    ([17, 1, 5], [0, 66, 3], 4, 128, 16, torch.float32),
    ([3, 12], [50, 21], 8, 64, 16, torch.float16),
    ([9, 2, 11], [0, 13, 40], 1, 80, 4, torch.bfloat16),
    ([9, 2, 11], [0, 13, 40], 4, 16, 4, torch.float16),
    ([1, 1, 1, 1], [0, 69, 7, 32], 8, 128, 16, torch.bfloat16),
    ([24], [0], 4, 80, 16, torch.float32),
    ([6, 6], [63, 64], 1, 128, 4, torch.float16),
    # A group that does not divide the tile's rows (Qwen2-0.5B has 7): the spare rows stay idle.
    ([5, 17], [12, 0], 7, 64, 4, torch.float32),
]


@pytest.mark.parametrize(("q_lens", "prefix_lens", "group", "head_dim", "block_size", "dtype"), KERNEL_CASES)
def test_kernel_matches_reference(q_lens, prefix_lens, group, head_dim, block_size, dtype):
    batch = make_batch(q_lens, prefix_lens, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype)
    assert_matches_reference(batch, paged_prefill_attention(*batch.args()))


# Small tiles put several query tiles in one request (the binary search over query_start_loc
# across many tiles) and several unmasked key tiles before the causal diagonal.
@pytest.mark.parametrize(("group", "block_m", "block_size", "dtype"), [
    (1, 16, 4, torch.float32),
    (2, 32, 16, torch.bfloat16),
    (8, 16, 4, torch.float16),
    (3, 16, 16, torch.float32),
])
def test_small_tiles_split_requests_and_contexts(group, block_m, block_size, dtype):
    batch = make_batch([20, 1, 13], [45, 60, 0], group=group, head_dim=64, block_size=block_size, dtype=dtype)
    tiles = PrefillTiles(block_m=block_m, block_n=16, num_warps=4, num_stages=2)
    assert_matches_reference(batch, paged_prefill_attention_tiled(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.query_start_loc,
        batch.context_lens, batch.scale, batch.block_size, tiles))


@pytest.mark.parametrize("block_size", [4, 16])
def test_rows_sharing_prefix_blocks(block_size):
    shared = 32 // block_size
    batch = make_batch([4, 9, 1], [36, 33, 40], group=4, head_dim=64, block_size=block_size,
                       dtype=torch.float16, shared_blocks=shared)
    assert (batch.block_tables[1:, :shared] == batch.block_tables[0, :shared]).all()
    assert_matches_reference(batch, paged_prefill_attention(*batch.args()))


def test_padding_block_ids_are_never_read():
    batch = make_batch([5, 3], [10, 2], group=2, head_dim=64, block_size=4)
    padding = batch.block_tables[:, 4:]
    assert (padding == -1).any() and (padding == HUGE_BLOCK_ID).any()
    out = paged_prefill_attention(*batch.args())
    assert_matches_reference(batch, out)
    # Whatever sits past each context must not matter.
    batch.block_tables[:, 4:] = 0
    torch.testing.assert_close(paged_prefill_attention(*batch.args()), out, atol=0, rtol=0)


@pytest.mark.parametrize(("group", "head_dim", "dtype"), [(1, 64, torch.float32), (4, 128, torch.bfloat16)])
def test_kernel_matches_sdpa_causal_without_cached_prefix(group, head_dim, dtype):
    batch = make_batch([23], [0], group=group, head_dim=head_dim, block_size=4, dtype=dtype)
    pos = torch.arange(23)
    slots = batch.block_tables[0, pos // 4].long() * 4 + pos % 4
    expected = F.scaled_dot_product_attention(
        batch.query.float().transpose(0, 1), batch.key_cache[slots].float().transpose(0, 1),
        batch.value_cache[slots].float().transpose(0, 1), is_causal=True, scale=batch.scale,
        enable_gqa=True).transpose(0, 1).to(dtype)
    torch.testing.assert_close(paged_prefill_attention(*batch.args()), expected, **TOLERANCES[dtype])


# A GPU keeps dot operands in the cache's dtype (P rounded to it before P.V); the interpreter
# computes fp16 and fp32 correctly, so that path is checked here too (bf16 only on a GPU).
@pytest.mark.parametrize(("dtype", "tolerance"), [
    (torch.float32, {"atol": 1e-5, "rtol": 1e-5}),
    (torch.float16, {"atol": 4e-3, "rtol": 4e-3}),
])
def test_cache_dtype_operands_as_on_a_gpu(dtype, tolerance):
    batch = make_batch([1, 5, 17], [30, 0, 9], group=4, head_dim=64, block_size=4, dtype=dtype)
    tiles = choose_tiles(batch.max_query_len, 4, 64, batch.key_cache.element_size())
    out = paged_prefill_attention_tiled(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.query_start_loc,
        batch.context_lens, batch.scale, batch.block_size, tiles, widen_operands=False)
    assert_matches_reference(batch, out, **tolerance)


def test_tiles_fold_the_query_group_into_at_least_16_rows():
    for max_query_len in (1, 5, 300):
        for group in (1, 2, 4, 7, 8, 16):
            for head_dim, element_size in ((64, 2), (128, 2), (80, 4), (256, 2)):
                tiles = choose_tiles(max_query_len, group, head_dim, element_size)
                assert tiles.block_m >= max(16, group) and tiles.block_n >= 16
                assert tiles.block_m & (tiles.block_m - 1) == 0 and tiles.block_n & (tiles.block_n - 1) == 0
    assert choose_tiles(1, 1, 128, 2).block_m == 16
    assert choose_tiles(2048, 1, 128, 2).block_m == 128
