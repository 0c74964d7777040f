"""Sizes the KV pool from what the GPU has free, as vLLM does, instead of a fixed budget.

After the weights are loaded, one profiling step runs the model at the full token budget
(max_num_batched_tokens, spread over up to max_num_seqs requests that all sample with
temperature, top-k/top-p and log-probabilities: the sampler's vocabulary-wide tensors are a
large part of a step's peak) with a cache just big enough for it, to see the peak memory a
step takes beyond the weights and that cache. The pool then gets what is left of
`gpu_memory_utilization` of the device:

    kv = total * utilization - (in use now: weights, CUDA context, other processes) - step peak

CUDA graphs are captured after the pool exists, from the (1 - utilization) margin: their
pool holds about one step's activations at the largest graph size plus one shared logits
buffer (workers/decode_graphs.py). The measure counts every process on the device: a second
engine on the same GPU gets what this one leaves, not half of it; the server starts the decoder
after its other workers on a GPU (frontend/worker_supervisor.py), so the encoder's tower, warm-up and
cache are counted. The encoder's global cache grows after start: encoder_cache_gib must fit in
the (1 - utilization) margin.
"""

from __future__ import annotations

import gc
import logging

import torch

from engine.config import GIB
from engine.executor import KVCacheSpec
from engine.sampling_params import SamplingParams

# What each profiling request asks of the sampler: its costliest path.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=20, seed=0)
from engine.scheduler_output import NewRequestData, SchedulerOutput

logger = logging.getLogger("antiphon")



def profile_kv_cache_bytes(make_runner, spec: KVCacheSpec, block_size: int, max_num_batched_tokens: int,
                           max_num_seqs: int, utilization: float, device: torch.device) -> int:
    """`make_runner(num_blocks)` builds a ModelRunner with a pool of that many blocks."""
    step, num_blocks = profiling_step(max_num_batched_tokens, max_num_seqs, block_size)
    runner = make_runner(num_blocks)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner.execute(step)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner, step
    gc.collect()
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


def profiling_step(max_num_batched_tokens: int, max_num_seqs: int, block_size: int) -> tuple[SchedulerOutput, int]:
    """A first step of the whole token budget over up to max_num_seqs new requests, and the
    blocks its cache needs (block 0 stays reserved, as in the engine's pool)."""
    num_rows = max(1, min(max_num_seqs, max_num_batched_tokens))
    # The first rows take one token more when the budget does not divide evenly.
    lengths = [max_num_batched_tokens // num_rows + (row < max_num_batched_tokens % num_rows)
               for row in range(num_rows)]
    blocks_per_row = -(-max(lengths) // block_size)
    step = SchedulerOutput()
    for row, length in enumerate(lengths):
        request_id = f"profile-{row}"
        blocks = list(range(1 + row * blocks_per_row, 1 + (row + 1) * blocks_per_row))
        step.new_requests.append(NewRequestData(request_id, [0] * length, length, PROFILE_SAMPLING, blocks, 0))
        step.num_scheduled_tokens[request_id] = length
    return step, num_rows * blocks_per_row + 1
