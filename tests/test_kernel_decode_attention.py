"""The Triton cache-write and decode kernels against their torch specifications, in Triton's CPU
interpreter.

Every decode batch is built so that reading anything outside a row's context shows: cache slots
no context covers hold NaN (a stray value read turns the output NaN through the P.V dot), and
block-table entries past a context hold -1, a huge id or the id of a NaN block. Split-K
workspaces are filled with NaN where a test needs to show that unwritten partials are never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import kernels.decode_attention as decode_module
from kernels.cache_write import write_kv_cache, write_kv_cache_reference
from kernels.decode_attention import (
    MAX_SPLITS,
    DecodeTiles,
    choose_num_splits,
    choose_tiles,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_attention_tiled,
)
from tests.paged_cache_cases import HUGE_BLOCK_ID, TOLERANCES, scattered_cache



@dataclass
class DecodeBatch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float
    block_size: int

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.context_lens, self.scale,
                self.block_size)


def make_batch(context_lens: list[int], *, num_kv_heads: int = 2, group: int = 1, head_dim: int = 64,
               block_size: int = 4, dtype: torch.dtype = torch.float32, shared_blocks: int = 0,
               extra_columns: int = 3, seed: int = 0) -> DecodeBatch:
    """Rows with the given context lengths, their blocks scattered over a larger cache in
    shuffled order. With shared_blocks, the first blocks of every later row with a context are
    row 0's (a shared prefix)."""
    gen = torch.Generator().manual_seed(seed)
    key_cache, value_cache, block_tables = scattered_cache(
        context_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        shared_blocks=shared_blocks, extra_columns=extra_columns, gen=gen)
    query = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen)
    return DecodeBatch(query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), block_tables,
                       torch.tensor(context_lens, dtype=torch.int32), head_dim**-0.5, block_size)


def naive_attention(batch: DecodeBatch) -> torch.Tensor:
    """One row, one head, one position at a time, with Python-int block-table lookups."""
    query, key_cache, value_cache = batch.query.double(), batch.key_cache.double(), batch.value_cache.double()
    group = query.shape[1] // key_cache.shape[1]
    out = torch.zeros_like(query)
    for r, context_len in enumerate(batch.context_lens.tolist()):
        slots = [int(batch.block_tables[r, j // batch.block_size]) * batch.block_size + j % batch.block_size
                 for j in range(context_len)]
        for h in range(query.shape[1]):
            scores = [float(query[r, h] @ key_cache[s, h // group]) * batch.scale for s in slots]
            if not scores:
                continue
            top = max(scores)
            weights = [math.exp(x - top) for x in scores]
            total = sum(weights)
            out[r, h] = sum(w / total * value_cache[s, h // group] for w, s in zip(weights, slots, strict=True))
    return out


def assert_matches_reference(batch: DecodeBatch, out: torch.Tensor, **tolerance) -> None:
    expected = paged_decode_attention_reference(*batch.args())
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert torch.isfinite(out).all(), "the kernel read a slot outside some context, or an unwritten partial"
    torch.testing.assert_close(out, expected, **(tolerance or TOLERANCES[batch.query.dtype]))


@pytest.fixture
def nan_workspace(monkeypatch):
    """Split-K workspaces full of NaN: any partial the combine reads without stage 1 having
    written it turns the output NaN."""
    allocate = decode_module.allocate_partials

    def allocate_nan(*args, **kwargs):
        return tuple(t.fill_(float("nan")) for t in allocate(*args, **kwargs))

    monkeypatch.setattr(decode_module, "allocate_partials", allocate_nan)


@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_naive_per_row_softmax(group):
    batch = make_batch([9, 14, 0, 5], group=group, head_dim=16, block_size=4, shared_blocks=1)
    expected = naive_attention(batch)
    assert expected[:2].abs().sum() > 0 and (expected[2] == 0).all()
    torch.testing.assert_close(paged_decode_attention_reference(*batch.args()), expected.float(),
                               atol=1e-5, rtol=1e-5)


# (context_lens, group, head_dim, block_size, dtype, num_splits): every case is a ragged batch in
# one launch, most contexts end mid-block; None lets the kernel pick the split count.
KERNEL_CASES = [
    ([1, 17, 70], 1, 64, 4, torch.float32, 1),
    ([1, 17, 70], 4, 64, 16, torch.float16, 3),
    ([33, 5, 64, 9], 8, 128, 4, torch.bfloat16, 2),
    ([70, 2], 4, 128, 16, torch.float32, 4),
    ([9, 40, 23], 1, 80, 4, torch.bfloat16, 1),
    ([9, 40, 23], 2, 16, 16, torch.float16, 2),
    ([0, 31, 12], 4, 64, 4, torch.float32, 2),
    # A group that is not a power of two (Qwen2-0.5B has 7): the spare rows of the tile stay idle.
    ([50, 3], 7, 64, 4, torch.float16, 8),
    # Contexts that end exactly on tile and block boundaries.
    ([64, 16, 48], 8, 128, 16, torch.bfloat16, None),
    ([65, 1], 1, 128, 4, torch.float16, 5),
]


@pytest.mark.parametrize(("context_lens", "group", "head_dim", "block_size", "dtype", "num_splits"), KERNEL_CASES)
def test_kernel_matches_reference(context_lens, group, head_dim, block_size, dtype, num_splits):
    batch = make_batch(context_lens, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype)
    assert_matches_reference(batch, paged_decode_attention(*batch.args(), num_splits=num_splits))


# 16-position tiles put several unmasked tiles and a masked tail in one split.
@pytest.mark.parametrize(("num_splits", "block_size", "dtype"), [
    (1, 4, torch.float32),
    (2, 16, torch.bfloat16),
    (3, 4, torch.float16),
])
def test_small_tiles_cover_splits_of_several_tiles(num_splits, block_size, dtype, nan_workspace):
    batch = make_batch([70, 33, 16, 1], group=4, head_dim=64, block_size=block_size, dtype=dtype)
    out = paged_decode_attention_tiled(*batch.args(), num_splits, DecodeTiles(block_n=16, num_warps=4, num_stages=2))
    assert_matches_reference(batch, out)


@pytest.mark.parametrize("block_size", [4, 16])
def test_rows_sharing_prefix_blocks(block_size):
    shared = 32 // block_size
    batch = make_batch([36, 33, 41], group=4, head_dim=64, block_size=block_size, dtype=torch.float16,
                       shared_blocks=shared)
    assert (batch.block_tables[1:, :shared] == batch.block_tables[0, :shared]).all()
    assert_matches_reference(batch, paged_decode_attention(*batch.args(), num_splits=2))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_block_ids_are_never_read(num_splits):
    batch = make_batch([15, 6], group=2, head_dim=64, block_size=4)
    padding = batch.block_tables[:, 4:]
    assert (padding == -1).any() and (padding == HUGE_BLOCK_ID).any()
    out = paged_decode_attention(*batch.args(), num_splits=num_splits)
    assert_matches_reference(batch, out)
    # Whatever sits past each context must not matter.
    batch.block_tables[:, 4:] = 0
    torch.testing.assert_close(paged_decode_attention(*batch.args(), num_splits=num_splits), out, atol=0, rtol=0)


def test_splits_past_a_short_context_are_empty_and_never_read(nan_workspace):
    # With 16-position tiles and 8 splits, row 0 (3 tokens) fills split 0 only and row 1
    # (70 tokens) splits 0-4: the rest write empty partials over a NaN workspace.
    batch = make_batch([3, 70], group=4, head_dim=64, block_size=4)
    out = paged_decode_attention_tiled(*batch.args(), 8, DecodeTiles(block_n=16, num_warps=4, num_stages=2))
    assert_matches_reference(batch, out)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_rows_without_context_give_zeros(num_splits, nan_workspace):
    batch = make_batch([0, 5, 0], group=4, head_dim=64, block_size=4)
    out = paged_decode_attention(*batch.args(), num_splits=num_splits)
    assert (out[0] == 0).all() and (out[2] == 0).all()
    assert_matches_reference(batch, out)
    empty = make_batch([0, 0], group=2, head_dim=64, block_size=4, extra_columns=2)
    assert (paged_decode_attention(*empty.args(), num_splits=num_splits) == 0).all()


def test_split_count_changes_nothing_but_rounding():
    batch = make_batch([70, 29, 1], group=2, head_dim=64, block_size=4)
    single = paged_decode_attention(*batch.args(), num_splits=1)
    for num_splits in (2, 3, 7):
        torch.testing.assert_close(paged_decode_attention(*batch.args(), num_splits=num_splits), single,
                                   atol=1e-6, rtol=1e-6)


# A GPU keeps dot operands in the cache's dtype (P rounded to it before P.V); the interpreter
# computes fp16 and fp32 correctly, so that path is checked here too (bf16 only on a GPU).
@pytest.mark.parametrize(("dtype", "tolerance"), [
    (torch.float32, {"atol": 1e-5, "rtol": 1e-5}),
    (torch.float16, {"atol": 4e-3, "rtol": 4e-3}),
])
def test_cache_dtype_operands_as_on_a_gpu(dtype, tolerance):
    batch = make_batch([1, 17, 70], group=4, head_dim=64, block_size=4, dtype=dtype)
    out = paged_decode_attention_tiled(*batch.args(), 2, choose_tiles(64, batch.key_cache.element_size()),
                                       widen_operands=False)
    assert_matches_reference(batch, out, **tolerance)


def test_split_count_follows_shapes():
    sms = 132
    # Contexts up to 256 positions never split.
    assert choose_num_splits(1, 2, 256, sms) == 1
    # A batch that fills the GPU with rows alone takes one split: no workspace, no second launch.
    assert choose_num_splits(256, 8, 32768, sms) == 1
    # One long stream takes many, up to the cap.
    assert choose_num_splits(1, 2, 32768, sms) == MAX_SPLITS
    # ... but never splits shorter than 256 positions.
    assert choose_num_splits(1, 8, 1024, sms) == 4
    counts = [choose_num_splits(batch, 8, 8192, sms) for batch in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] == 1
    # Fewer SMs to fill, fewer splits.
    assert choose_num_splits(4, 8, 8192, 16) < choose_num_splits(4, 8, 8192, sms)


def test_default_split_count_runs_split_k():
    # 80 columns of 4-token blocks: the longest possible context (320) takes 2 splits by
    # length, so the default goes through the workspace and the combine.
    batch = make_batch([70, 5], group=4, head_dim=64, block_size=4, extra_columns=62)
    assert batch.block_tables.shape[1] == 80
    assert choose_num_splits(2, 2, 320, decode_module.device_sm_count(batch.query.device)) == 2
    assert_matches_reference(batch, paged_decode_attention(*batch.args()))


def test_decode_attends_to_the_token_write_kv_cache_just_wrote():
    # Each row's newest position is still NaN in the cache until the write; a padded row
    # (slot -1, context 0) writes nothing and reads nothing.
    batch = make_batch([13, 40, 0], group=2, head_dim=64, block_size=4, dtype=torch.float16)
    gen = torch.Generator().manual_seed(1)
    slots = []
    for r, context_len in enumerate(batch.context_lens.tolist()):
        last = context_len - 1
        slot = int(batch.block_tables[r, last // 4]) * 4 + last % 4 if context_len else -1
        if slot >= 0:
            batch.key_cache[slot] = float("nan")
            batch.value_cache[slot] = float("nan")
        slots.append(slot)
    key = torch.randn(3, 2, 64, generator=gen).to(torch.float16)
    value = torch.randn(3, 2, 64, generator=gen).to(torch.float16)
    write_kv_cache(key, value, batch.key_cache, batch.value_cache, torch.tensor(slots))
    assert torch.equal(batch.key_cache[slots[1]], key[1]) and torch.equal(batch.value_cache[slots[0]], value[0])
    assert_matches_reference(batch, paged_decode_attention(*batch.args(), num_splits=2))


# (key dtype, cache dtype, slot dtype, num_heads, head_dim)
WRITE_CASES = [
    (torch.float32, torch.float16, torch.int64, 2, 64),
    (torch.float32, torch.bfloat16, torch.int32, 2, 128),
    (torch.bfloat16, torch.bfloat16, torch.int64, 1, 80),
    (torch.float16, torch.float32, torch.int32, 3, 16),
    (torch.bfloat16, torch.float32, torch.int64, 2, 64),
    (torch.float16, torch.bfloat16, torch.int64, 2, 64),
]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("key_dtype", "cache_dtype", "slot_dtype", "num_heads", "head_dim"), WRITE_CASES)
def test_write_kv_cache_matches_reference(key_dtype, cache_dtype, slot_dtype, num_heads, head_dim, fused):
    gen = torch.Generator().manual_seed(0)
    tokens = 7
    if fused:
        # Keys and values as views into one fused projection: strided rows.
        qkv = torch.randn(tokens, 3 * num_heads, head_dim, generator=gen).to(key_dtype)
        key, value = qkv[:, num_heads:2 * num_heads], qkv[:, 2 * num_heads:]
    else:
        key = torch.randn(tokens, num_heads, head_dim, generator=gen).to(key_dtype)
        value = torch.randn(tokens, num_heads, head_dim, generator=gen).to(key_dtype)
    key_cache = torch.randn(40, num_heads, head_dim, generator=gen).to(cache_dtype)
    value_cache = torch.randn(40, num_heads, head_dim, generator=gen).to(cache_dtype)
    slot_mapping = torch.tensor([5, -1, 39, 0, -7, 17, 6], dtype=slot_dtype)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    write_kv_cache_reference(key, value, expected_keys, expected_values, slot_mapping)
    before_keys, before_values = key_cache.clone(), value_cache.clone()

    write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    written = torch.tensor([5, 39, 0, 17, 6])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(key_cache[untouched], before_keys[untouched])
    assert torch.equal(value_cache[untouched], before_values[untouched])
    assert not torch.equal(key_cache[written], before_keys[written])
    # Triton's interpreter truncates fp32 to bf16 where a GPU (and torch) rounds to nearest:
    # up to one bf16 ulp apart. Every other conversion is exact.
    tolerance = {"atol": 0, "rtol": 2**-7} if cache_dtype == torch.bfloat16 != key_dtype else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(key_cache, expected_keys, **tolerance)
    torch.testing.assert_close(value_cache, expected_values, **tolerance)


def test_write_kv_cache_with_every_slot_negative_writes_nothing():
    key = torch.randn(4, 2, 64)
    key_cache = torch.randn(16, 2, 64)
    value_cache = torch.randn(16, 2, 64)
    before = key_cache.clone(), value_cache.clone()
    write_kv_cache(key, key, key_cache, value_cache, torch.full((4,), -1))
    write_kv_cache(key[:0], key[:0], key_cache, value_cache, torch.empty(0, dtype=torch.long))
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
