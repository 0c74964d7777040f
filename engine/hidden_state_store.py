"""Per-position thinker outputs that an omni model's talker consumes (hidden states and input
embeddings), kept in the KV pool's own layout so prefix caching covers them (seed 002).

The store holds one row per KV slot: block b's positions are rows b * block_size ... + block_size
- 1, and a step writes its rows through the step's slot mapping, exactly where its keys and
values go. A prefix-cache hit on blocks therefore finds the hidden rows of those positions
without recomputing them, and eviction needs no bookkeeping of its own: a reallocated block is
overwritten as its KV is.

One race needs guarding (seed 002): a full block's hash is published when the block is
scheduled (engine/kv_cache_manager.py), before the forward that computes it has run, so a
request scheduled in the same step, or read by another process meanwhile, can hit a block whose
rows do not exist yet. KV is safe (the forward writes keys before any attention reads them);
the talker's rows are read after the forward. So each block counts the rows written into it
since it was (re)allocated, and `read` refuses a block that is not whole yet: the caller asks
again after the step that fills it. Only full blocks are ever read as hits, as in the KV cache;
a trailing partial block is recomputed by its request.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("antiphon")


class HiddenStoreTooLarge(ValueError):
    """The store for this model and KV pool would exceed the host memory it is allowed."""


class HiddenStateStore:
    def __init__(self, num_blocks: int, block_size: int, width: int, dtype: torch.dtype = torch.float32,
                 max_bytes: int | None = None) -> None:
        size = self.bytes_for(num_blocks, block_size, width, dtype)
        if max_bytes is not None and size > max_bytes:
            raise HiddenStoreTooLarge(
                f"the hidden-state store needs {size / 2**20:.1f} MiB ({num_blocks} blocks x {block_size} positions x "
                f"{width} features x {dtype}), over its limit of {max_bytes / 2**20:.1f} MiB: raise the limit or give "
                f"the KV pool fewer blocks")
        self.num_blocks, self.block_size, self.width = num_blocks, block_size, width
        self.rows = torch.zeros(num_blocks * block_size, width, dtype=dtype)
        # Rows written into each block since it was last (re)allocated.
        self.written = torch.zeros(num_blocks, dtype=torch.int64)
        logger.info("hidden-state store: %d blocks x %d positions x %d features (%s), %.1f MiB", num_blocks,
                    block_size, width, dtype, size / 2**20)

    @staticmethod
    def bytes_for(num_blocks: int, block_size: int, width: int, dtype: torch.dtype) -> int:
        return num_blocks * block_size * width * torch.empty((), dtype=dtype).element_size()

    def allocated(self, block_ids: list[int]) -> None:
        """Blocks handed to a request afresh: whatever they held is no longer theirs."""
        if block_ids:
            self.written[torch.as_tensor(block_ids, dtype=torch.int64)] = 0

    def write(self, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """A step's rows [T, width], each at its position's KV slot (the step's slot mapping, [T]).
        Each slot is written once per allocation of its block, as its keys and values are."""
        if rows.shape != (slot_mapping.shape[0], self.width):
            raise ValueError(f"rows of shape {tuple(rows.shape)} for {slot_mapping.shape[0]} slots of width {self.width}")
        slots = slot_mapping.to(torch.int64)
        self.rows.index_copy_(0, slots, rows.to(self.rows.dtype))
        self.written += torch.bincount(slots // self.block_size, minlength=self.num_blocks)

    def is_whole(self, block_id: int) -> bool:
        return int(self.written[block_id]) >= self.block_size

    def read_positions(self, block_ids: list[int], start: int, end: int) -> torch.Tensor | None:
        """The rows of one request's positions start..end-1 ([end - start, width]), its blocks
        `block_ids` in order; None while any of them is not written through yet. A block's
        rows are written from its first slot on, so a block covering positions up to `end`
        holds them all once it counts that many rows since its allocation."""
        if end <= start:
            return self.rows.new_empty(0, self.width)
        size = self.block_size
        first, last = start // size, (end - 1) // size
        if last >= len(block_ids):
            raise ValueError(f"positions up to {end} need {last + 1} blocks; the request has {len(block_ids)}")
        blocks = torch.as_tensor(block_ids[first:last + 1], dtype=torch.int64)
        needed = torch.full((len(blocks),), size, dtype=torch.int64)
        needed[-1] = end - last * size
        if bool((self.written[blocks] < needed).any()):
            return None
        positions = torch.arange(start, end)
        slots = blocks[positions // size - first] * size + positions % size
        return self.rows.index_select(0, slots)

    def read(self, block_ids: list[int]) -> torch.Tensor | None:
        """The rows of whole blocks (a prefix hit), [len(block_ids) * block_size, width], in
        order; None while any of them is not written through yet."""
        if not block_ids:
            return self.rows.new_empty(0, self.width)
        index = torch.as_tensor(block_ids, dtype=torch.int64)
        if bool((self.written[index] < self.block_size).any()):
            return None
        slots = (index.unsqueeze(1) * self.block_size + torch.arange(self.block_size)).reshape(-1)
        return self.rows.index_select(0, slots)
