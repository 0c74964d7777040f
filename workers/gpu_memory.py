"""Sizes the KV pool from what the GPU has free, as vLLM does, instead of a fixed budget.

After the weights are loaded, one profiling step runs the model at the full token budget
(max_num_batched_tokens, spread over up to max_num_seqs requests that all sample) with a
cache just big enough for it, to see the peak memory a step takes beyond the weights. The
pool then gets what is left of `gpu_memory_utilization` of the device:

    kv = total * utilization - (in use now: weights, CUDA context, other processes) - step peak

CUDA graphs are captured after the pool exists; their memory is small beside it and comes
out of the (1 - utilization) margin.
"""

from __future__ import annotations

import logging

import torch

from engine.executor import KVCacheSpec
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, SchedulerOutput

logger = logging.getLogger("antiphon")

GIB = 1 << 30


def profile_kv_cache_bytes(make_runner, spec: KVCacheSpec, block_size: int, max_num_batched_tokens: int,
                           max_num_seqs: int, utilization: float, device: torch.device) -> int:
    """`make_runner(num_blocks)` builds a ModelRunner with a pool of that many blocks."""
    num_rows = max(1, min(max_num_seqs, max_num_batched_tokens))
    per_row = max_num_batched_tokens // num_rows
    blocks_per_row = -(-per_row // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner = make_runner(num_rows * blocks_per_row + 1)
    step = SchedulerOutput()
    for row in range(num_rows):
        request_id = f"profile-{row}"
        blocks = list(range(1 + row * blocks_per_row, 1 + (row + 1) * blocks_per_row))
        step.new_requests.append(NewRequestData(request_id, [0] * per_row, per_row, SamplingParams(temperature=0),
                                                blocks, 0))
        step.num_scheduled_tokens[request_id] = per_row
    runner.execute(step)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - (total - free) - peak
    logger.info("GPU memory: %.1f GiB total, %.1f GiB in use after loading, profiling step peak %.2f GiB "
                "-> %.2f GiB for the KV cache at gpu_memory_utilization %.2f", total / GIB, (total - free) / GIB,
                peak / GIB, budget / GIB, utilization)
    if budget < 2 * spec.bytes_per_block(block_size):
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {(total - free) / GIB:.1f} GiB of {total / GIB:.1f} GiB are in "
            f"use and a step at max_num_batched_tokens={max_num_batched_tokens} peaks at {peak / GIB:.2f} GiB; "
            f"raise --gpu-memory-utilization ({utilization}) or lower --max-num-batched-tokens")
    return budget
