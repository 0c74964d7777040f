"""CUDA graphs of pure-decode steps.

A decode step of a small model is hundreds of small kernel launches issued from Python; the
GPU waits on the host. A CUDA graph records the step's launches once and replays them in one
call. Graphs run on fixed addresses, so the step's inputs live in static buffers sized for
the largest batch, refilled in place before each replay, and a batch is padded up to the
next captured size: padded rows write no cache slot (slot -1) and attend to nothing
(context length 0), so their logits are ignored. Batches above the largest size run eagerly.
Every graph writes its logits into one shared output buffer: a buffer per graph would keep
a [size, vocab] tensor alive for each of dozens of sizes (gigabytes with a large vocabulary).

Everything the captured forward reads is in those buffers: the Triton attention path reads
block tables and context lengths on the device and makes its launch decisions from shapes
only (workers/paged_attention.py); the number of block-table columns is fixed at the most a
request can ever hold (max_model_len), so one graph serves every context length.

"padded-eager" mode runs the same buffers and padding without capturing: what a CPU can test
(with the kernels in Triton's interpreter) and a way to tell a capture bug from a padding one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from workers.host_staging import HostToDevice
from workers.forward_context import set_forward_context
from workers.paged_attention import BlockTableMetadata

logger = logging.getLogger("antiphon")

# (input_ids [1, B], positions [1, B]) -> logits [B, vocab], under forward_context.
DecodeForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def batch_size_ladder(max_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_size (and max_size itself): padding wastes
    at most 7 rows above 8, and each size costs one capture at start."""
    sizes = [s for s in (1, 2, 4) if s < max_size] + list(range(8, max_size, 8))
    return sorted(set(sizes) | {max_size})


class DecodeGraphs:
    def __init__(self, forward: DecodeForward, kv_caches: list, block_size: int, max_model_len: int,
                 max_batch_size: int, device: torch.device, capture: bool, to_device: HostToDevice) -> None:
        self.forward = forward
        self.to_device = to_device
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        max_blocks_per_row = -(-max_model_len // block_size)
        self.device = device
        self.record = capture
        self.sizes = batch_size_ladder(max_batch_size)
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_row, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # [largest, vocab], made at capture: every graph's logits land in its first rows.
        self.logits: torch.Tensor | None = None
        # Steps that ran through these buffers (graph replays or padded-eager runs).
        self.steps_run = 0

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, batch_size: int) -> int | None:
        """The captured size a batch runs at, or None when it is too big for any."""
        for size in self.sizes:
            if size >= batch_size:
                return size
        return None

    def capture(self) -> None:
        """Record one graph per size, largest first so the smaller ones reuse its memory pool."""
        if not self.record:
            return
        started = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            # A first eager run outside the capture: Triton compiles its kernels and the
            # allocator settles; neither may happen while recording.
            warm = self._forward(size)
            if self.logits is None:
                self.logits = torch.empty(self.max_batch_size, warm.shape[-1], dtype=warm.dtype, device=self.device)
            del warm
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                # The forward's own logits are freed when the capture ends: the next (smaller)
                # capture reuses that pool memory, and replays run one at a time.
                self.logits[:size].copy_(self._forward(size))
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs: captured %d decode batch sizes (1..%d) in %.1f s", len(self.sizes),
                    self.max_batch_size, time.perf_counter() - started)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            block_tables: np.ndarray, context_lens: np.ndarray) -> torch.Tensor:
        """One decode step of len(input_ids) rows -> logits [rows, vocab]."""
        rows = len(input_ids)
        size = self.padded_size(rows)
        if size is None:
            raise ValueError(f"a decode batch of {rows} is above the largest graph ({self.max_batch_size})")
        if block_tables.shape[1] > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {block_tables.shape[1]} blocks is wider than the graphs' "
                             f"{self.block_tables.shape[1]} (max_model_len {self.max_model_len})")
        for name, static, values in (("graph_input_ids", self.input_ids, input_ids),
                                     ("graph_positions", self.positions, positions),
                                     ("graph_slot_mapping", self.slot_mapping, slot_mapping),
                                     ("graph_context_lens", self.context_lens, context_lens)):
            static[:rows].copy_(self.to_device(name, values))
        self.block_tables[:rows, :block_tables.shape[1]].copy_(self.to_device("graph_block_tables", block_tables))
        # Padded rows: no slot written, nothing attended; position 0 because some RoPE
        # variants (long RoPE) pick their scaling from the largest position in the batch.
        self.slot_mapping[rows:size].fill_(-1)
        self.context_lens[rows:size].zero_()
        self.positions[rows:size].zero_()
        self.steps_run += 1
        if not self.record:
            return self._forward(size)[:rows]
        self.graphs[size].replay()
        return self.logits[:rows]

    def _forward(self, size: int) -> torch.Tensor:
        meta = BlockTableMetadata(
            slot_mapping=self.slot_mapping[:size], kv_caches=self.kv_caches, block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], block_size=self.block_size, num_decodes=size,
            prefill_query_start_loc=None, max_prefill_query_len=0,
            max_context_len=self.max_model_len)
        with set_forward_context(meta):
            return self.forward(self.input_ids[:size].unsqueeze(0), self.positions[:size].unsqueeze(0))
