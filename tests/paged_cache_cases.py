"""Paged caches for the kernel tests: blocks scattered in shuffled order over a cache twice as
big as needed, NaN in every slot outside a context, and block-table padding that points at
-1, an id far past the cache, or an all-NaN block, so a kernel that reads outside a context
either faults or shows NaN."""

from __future__ import annotations

import math

import torch

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
HUGE_BLOCK_ID = 2**31 - 1


def scattered_cache(context_lens: list[int], *, num_kv_heads: int, head_dim: int, block_size: int,
                    shared_blocks: int, extra_columns: int,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache, block_tables) in float32 for rows of the given context lengths.
    With shared_blocks, the first blocks of every later row with a context are row 0's (a
    shared prefix, written once)."""
    blocks_per_row = [math.ceil(c / block_size) for c in context_lens]
    max_blocks = max(blocks_per_row) + extra_columns
    num_blocks = 2 * sum(blocks_per_row) + 2
    free_ids = torch.randperm(num_blocks, generator=gen).tolist()
    poison_block = free_ids.pop()
    garbage = [-1, HUGE_BLOCK_ID, poison_block]
    block_tables = torch.empty(len(context_lens), max_blocks, dtype=torch.int32)
    for r, needed in enumerate(blocks_per_row):
        if r > 0 and shared_blocks and needed:
            assert needed >= shared_blocks and blocks_per_row[0] >= shared_blocks
            row = block_tables[0, :shared_blocks].tolist() + [free_ids.pop() for _ in range(needed - shared_blocks)]
        else:
            row = [free_ids.pop() for _ in range(needed)]
        row += [garbage[(r + j) % len(garbage)] for j in range(max_blocks - needed)]
        block_tables[r] = torch.tensor(row, dtype=torch.int32)

    num_slots = num_blocks * block_size
    key_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"))
    value_cache = torch.full((num_slots, num_kv_heads, head_dim), float("nan"))
    for r, context_len in enumerate(context_lens):
        pos = torch.arange(context_len)
        slots = block_tables[r, pos // block_size].long() * block_size + pos % block_size
        # Shared slots keep their first values: a shared block holds one prefix.
        fresh = torch.isnan(key_cache[slots, 0, 0])
        key_cache[slots[fresh]] = torch.randn(int(fresh.sum()), num_kv_heads, head_dim, generator=gen)
        value_cache[slots[fresh]] = torch.randn(int(fresh.sum()), num_kv_heads, head_dim, generator=gen)
    return key_cache, value_cache, block_tables
