"""Antiphon on an NVIDIA GPU, in one run: kernel correctness, decode attention against the memory
roofline, and end-to-end decode throughput against transformers on the same model and prompts.

1. check: each Triton kernel (kernels/) against its torch reference on the device, over a grid of
   ragged batches: GQA groups 1/4/8, head dim 64/128, fp16 and bf16, contexts from 1 to ~4k tokens
   ending mid-block, block size 16; decode also with a padded row (context 0) and with the split
   count it picks, one split and three; the cache write with skipped (negative) slots. Unused
   cache slots hold NaN and block-table padding points at an all-NaN block, so a kernel that
   reads outside a context shows. The run exits 1 (and skips the rest) if any case fails.
2. roofline: paged_decode_attention with Llama-3-8B's attention (32 query heads, 8 KV heads, head
   dim 128, bf16) for batch sizes 1/8/32/128 x contexts 1k/4k/16k. Timed with CUDA events inside a
   CUDA graph (as the engine's decode graphs run it), the median of many replays; consecutive
   calls read different blocks of a cache several times larger than L2, so every byte comes from
   HBM. Its bandwidth (bytes of K/V, query, output and block table / time) is set against the
   device-to-device copy bandwidth measured in the same run (the achievable roofline) and the
   device's nominal peak (a read-only kernel may pass 100% of the copy, which also writes). The
   baseline is the engine's torch fallback for the same shape (workers/paged_attention's
   decode_attention: gather the slots, one SDPA), timed eagerly, as the engine's torch backend
   runs it. Aim: >= 70% of the measured copy bandwidth for contexts >= 1k. A shape the memory
   cannot hold is skipped, not failed.
3. e2e: output tokens/s of N prompts (random ids, 128-512 tokens, fixed seed) x M new tokens,
   greedy, EOS ignored, on one model: by default a random-weight Llama with Llama-3.2-1B's shape
   (bf16), built once under $ANTIPHON_CACHE/bench-models (a temporary folder when ANTIPHON_CACHE
   is unset), or a local checkpoint folder with --model. Rows: the engine with CUDA graphs, the
   engine eager, the engine with the torch attention backend, transformers' continuous batching
   (`generate_batch`, sdpa: the baseline of the ratios) and transformers `generate` on one
   left-padded batch. Each runs the whole workload once to warm up (Triton compiles, graphs,
   allocator), then --reps timed runs, best kept; start-up (load, profiling, graph capture) and
   the warm-up run are reported apart. One engine or model is alive at a time; prefix caching
   is off everywhere, so repeated prompts are recomputed. Aim: engine >= 3x transformers'
   continuous batching.

    python benchmarks/gpu.py                          # everything (a few minutes on an H100)
    python benchmarks/gpu.py --check-only             # the kernel check alone
    python benchmarks/gpu.py --model /models/Llama-3.2-1B --json results.json
    python benchmarks/gpu.py --tiny                   # a smoke run: tiny shapes everywhere
    TRITON_INTERPRET=1 python benchmarks/gpu.py --check-only --tiny --device cpu   # on a CPU

Nothing is ever downloaded. The table's columns:
  part        check / roofline / e2e
  case        the kernel and dtype (check), batch x context (roofline), what runs (e2e)
  measured    check: worst max |error| over the cases and its tolerance; roofline: time per
              call in a CUDA graph, bandwidth, and the time eagerly launched; e2e: output tok/s
              of the best timed run, start-up and warm-up seconds
  baseline    what the ratio is taken against: the torch reference, the nominal peak, the torch
              fallback kernel, transformers' continuous batching
  vs baseline measured / baseline as a speed-up (or % of the nominal peak for the copy row)
  vs roofline roofline rows: bandwidth as % of the measured copy bandwidth, and of the nominal
  aim         the issue's target and whether this run met it; check rows: pass / FAIL

Exit status: 0; 1 when a check fails or a measurement errors (its row says how); 2 when there is
no GPU (or --device cpu lacks --check-only or TRITON_INTERPRET=1).

One file on purpose (~890 lines): the device run copies and runs one script, with no import
from the repo beyond the engine and kernels it measures.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK_SIZE = 16
GIB = 1 << 30
# |kernel - reference| <= atol + rtol * |reference|, elementwise; the reference sums in fp32.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
KERNELS = ("write_kv_cache", "paged_decode_attention", "paged_prefill_attention")
# Decode runs with the split count it picks, with one split (no workspace) and with three.
DECODE_SPLITS = (None, 1, 3)

# Roofline shape: Llama-3-8B's attention.
ROOFLINE_HEADS = (32, 8, 128)  # query heads, kv heads, head dim
ROOFLINE_DTYPE = torch.bfloat16
ROOFLINE_AIM = 0.70

# The default e2e model: Llama-3.2-1B's shape with random weights.
LLAMA_3_2_1B = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
E2E_AIM = 3.0


@dataclass
class Row:
    part: str
    case: str
    measured: str
    baseline: str = "-"
    vs_baseline: str = "-"
    vs_roofline: str = "-"
    aim: str = "-"
    # pass / fail (check), ok, skipped (out of memory: expected on small devices), error
    status: str = "ok"
    data: dict = field(default_factory=dict)


def report_progress(row: Row) -> None:
    print(f"[{row.part}] {row.case}: {row.measured}"
          + (f"; {row.vs_baseline} vs {row.baseline}" if row.vs_baseline != "-" else "")
          + (f"; {row.aim}" if row.aim != "-" else ""), flush=True)


def one_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:limit] if text else ''}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Between configurations: drop what the last one left (the caller dropped its references)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ---- 1. kernel check ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckGrid:
    dtypes: tuple[torch.dtype, ...]
    # (num_kv_heads, query heads per kv head, head_dim)
    heads: tuple[tuple[int, int, int], ...]
    decode_contexts: tuple[int, ...]
    # (cached prefix, new tokens) of each prefill request
    prefill_chunks: tuple[tuple[int, int], ...]
    num_writes: int


GPU_GRID = CheckGrid(
    dtypes=(torch.float16, torch.bfloat16),
    heads=tuple((2, group, dim) for group in (1, 4, 8) for dim in (64, 128)),
    decode_contexts=(0, 1, 16, 17, 250, 1000, 2049, 4095),
    prefill_chunks=((0, 1), (0, 17), (15, 1), (100, 37), (1000, 95), (3900, 195)),
    num_writes=1000,
)
# The interpreter runs ~15 ms per program: a handful of programs per case.
TINY_GRID = CheckGrid(
    dtypes=(torch.float32, torch.float16),
    heads=((2, 1, 16), (1, 4, 64), (2, 2, 64), (1, 8, 16)),
    decode_contexts=(0, 1, 17, 40, 63),
    prefill_chunks=((0, 5), (3, 1), (16, 21), (30, 33)),
    num_writes=37,
)


@dataclass
class PagedCache:
    key_cache: torch.Tensor  # [num_blocks * BLOCK_SIZE, Hkv, D]; NaN outside every context
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [R, max_blocks]; padding points at an all-NaN block


def paged_cache(context_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, gen: torch.Generator) -> PagedCache:
    """Each row's blocks scattered over a cache twice the size needed, in random order."""
    needed = [math.ceil(c / BLOCK_SIZE) for c in context_lens]
    max_blocks = max(needed) + 2
    num_blocks = 2 * sum(needed) + 1
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    poison = ids.pop()
    tables = torch.full((len(context_lens), max_blocks), poison, dtype=torch.int32)
    shape = (num_blocks * BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    for row, (context_len, count) in enumerate(zip(context_lens, needed)):
        blocks = [ids.pop() for _ in range(count)]
        tables[row, :count] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(context_len)
        slots = tables[row, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        key_cache[slots] = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        value_cache[slots] = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    return PagedCache(key_cache.to(device), value_cache.to(device), tables.to(device))


def compare(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> tuple[float, bool]:
    """(max |error|, within tolerance); NaN in the same places on both sides counts as equal
    (untouched NaN cache slots), NaN on one side only is an infinite error."""
    actual, expected = actual.float(), expected.float()
    both_nan = actual.isnan() & expected.isnan()
    error = (actual - expected).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=float("inf"))
    ok = bool((error <= atol + rtol * expected.abs().masked_fill(both_nan, 0.0)).all())
    return (error.max().item() if error.numel() else 0.0), ok


def check_write(grid: CheckGrid, dtype, num_kv_heads, head_dim, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.cache_write import write_kv_cache, write_kv_cache_reference

    num_slots = BLOCK_SIZE * math.ceil(4 * grid.num_writes / BLOCK_SIZE)
    key = torch.randn(grid.num_writes, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(grid.num_writes, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_slots, generator=gen)[:grid.num_writes]
    slots[::5] = -1  # padding rows: written nowhere
    slots = slots.to(device)
    caches = [torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
              for _ in range(4)]
    write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_cache_reference(key, value, caches[2], caches[3], slots)
    return torch.cat([caches[0], caches[1]]), torch.cat([caches[2], caches[3]])


def check_decode(grid: CheckGrid, dtype, num_kv_heads, group, head_dim, device, gen):
    from kernels.decode_attention import (
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    contexts = list(grid.decode_contexts)
    cache = paged_cache(contexts, num_kv_heads, head_dim, dtype, device, gen)
    query = torch.randn(len(contexts), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, context_lens, head_dim ** -0.5, BLOCK_SIZE)
    expected = paged_decode_attention_reference(*args)
    # The split count the kernel picks, one split (no workspace) and an odd forced count.
    actual = torch.stack([paged_decode_attention(*args, num_splits=splits) for splits in DECODE_SPLITS])
    return actual, expected.expand_as(actual)


def check_prefill(grid: CheckGrid, dtype, num_kv_heads, group, head_dim, device, gen):
    from kernels.prefill_attention import (
        paged_prefill_attention,
        paged_prefill_attention_reference,
    )

    contexts = [prefix + new for prefix, new in grid.prefill_chunks]
    q_lens = [new for _, new in grid.prefill_chunks]
    cache = paged_cache(contexts, num_kv_heads, head_dim, dtype, device, gen)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, starts, context_lens, max(q_lens),
            head_dim ** -0.5, BLOCK_SIZE)
    return paged_prefill_attention(*args), paged_prefill_attention_reference(*args)


def run_check(grid: CheckGrid, device: torch.device) -> list[Row]:
    """One row per kernel and dtype: the worst case of the grid, and every failing case by name."""
    rows = []
    for kernel in KERNELS:
        for dtype in grid.dtypes:
            atol, rtol = (0.0, 0.0) if kernel == "write_kv_cache" else TOLERANCES[dtype]
            worst, failures, cases = 0.0, [], 0
            heads = grid.heads
            if kernel == "write_kv_cache":
                # GQA does not reach the cache write: as many kv heads as the grid has query heads.
                heads = tuple(dict.fromkeys((kv * group, 1, dim) for kv, group, dim in heads))
            for num_kv_heads, group, head_dim in heads:
                name = f"Hkv {num_kv_heads} G {group} D {head_dim}"
                gen = torch.Generator().manual_seed(cases)
                cases += 1
                raised = False
                try:
                    if kernel == "write_kv_cache":
                        actual, expected = check_write(grid, dtype, num_kv_heads, head_dim, device, gen)
                    elif kernel == "paged_decode_attention":
                        actual, expected = check_decode(grid, dtype, num_kv_heads, group, head_dim, device, gen)
                    else:
                        actual, expected = check_prefill(grid, dtype, num_kv_heads, group, head_dim, device, gen)
                    error, ok = compare(actual, expected, atol, rtol)
                except Exception as exc:  # noqa: BLE001 -- a kernel that raises fails its case, not the run
                    error, ok, raised = float("inf"), False, True
                    name += f" raised {one_line(exc, 120)}"
                worst = max(worst, error)
                if not ok:
                    failures.append(name if raised else f"{name} (max err {error:.2e})")
            tolerance = "exact" if kernel == "write_kv_cache" else f"atol=rtol={atol:g}"
            status = "fail" if failures else "pass"
            rows.append(Row(
                "check", f"{kernel} {DTYPE_NAMES[dtype]} ({cases} shapes)",
                f"max err {worst:.1e} ({tolerance})", "torch reference",
                aim="pass" if not failures else "FAIL: " + "; ".join(failures), status=status,
                data={"kernel": kernel, "dtype": DTYPE_NAMES[dtype], "max_abs_error": worst, "cases": cases,
                      "failures": failures}))
            report_progress(rows[-1])
    return rows


# ---- 2. decode attention vs the memory roofline --------------------------------------------------

# Nominal HBM bandwidth (TB/s) by device name, most specific first.
NOMINAL_BANDWIDTH = (
    (("H200",), 4.8, "H200"),
    (("H100", "PCIE"), 2.0, "H100 PCIe"),
    (("H100", "NVL"), 3.9, "H100 NVL"),
    (("H100",), 3.35, "H100 SXM"),
    (("A100", "80GB", "PCIE"), 1.935, "A100 80GB PCIe"),
    (("A100", "80GB"), 2.039, "A100 80GB SXM"),
    (("A100",), 1.555, "A100 40GB"),
)


def nominal_bandwidth(name: str) -> tuple[float | None, str]:
    upper = name.upper()
    for words, tbs, label in NOMINAL_BANDWIDTH:
        if all(word in upper for word in words):
            return tbs * 1e12, label
    return None, "unknown device"


def copy_bandwidth(device: torch.device, nbytes: int = 2 * GIB) -> tuple[float, int]:
    """Read + write bytes / time of a device-to-device copy far beyond L2, median of 20."""
    while True:
        try:
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            break
        except torch.cuda.OutOfMemoryError:
            nbytes //= 2
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times), nbytes


def seconds_per_call(calls: list[Callable[[], object]], rounds: int, graph: bool) -> float:
    """Median over `rounds` of (one pass over `calls`) / len(calls), timed with CUDA events;
    with graph=True the pass is captured once and replayed (no launch overhead)."""
    captured = None
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for call in calls:
                call()

    def run() -> None:
        if captured is not None:
            captured.replay()
        else:
            for call in calls:
                call()

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times)


@dataclass
class DecodeShape:
    batch: int
    context: int

    def kv_bytes(self, element_size: int) -> int:
        _, num_kv_heads, head_dim = ROOFLINE_HEADS
        return 2 * self.batch * self.context * num_kv_heads * head_dim * element_size

    def bytes_moved(self, element_size: int) -> int:
        """What one call must move at least: every K/V byte of the contexts, the query, the
        output, the block table rows and the context lengths."""
        num_q_heads, _, head_dim = ROOFLINE_HEADS
        table = self.batch * math.ceil(self.context / BLOCK_SIZE) * 4 + self.batch * 4
        return self.kv_bytes(element_size) + 2 * self.batch * num_q_heads * head_dim * element_size + table


def time_decode_shape(shape: DecodeShape, device: torch.device, l2_bytes: int, dtype: torch.dtype) -> dict:
    """Triton kernel (graph and eager) and the torch fallback for one shape, seconds per call."""
    from kernels.decode_attention import paged_decode_attention
    from workers.paged_attention import decode_attention

    num_q_heads, num_kv_heads, head_dim = ROOFLINE_HEADS
    element = dtype.itemsize
    # Rotate over several disjoint sets of blocks: a set is read again only after the others
    # have pushed it out of L2.
    sets = min(64, max(1, math.ceil(4 * l2_bytes / shape.kv_bytes(element))))
    blocks_per_row = math.ceil(shape.context / BLOCK_SIZE)
    num_blocks = sets * shape.batch * blocks_per_row
    free, _ = torch.cuda.mem_get_info(device)
    needed = 2 * num_blocks * BLOCK_SIZE * num_kv_heads * head_dim * element
    if needed > 0.8 * free:
        raise torch.cuda.OutOfMemoryError(f"needs {needed / GIB:.2f} GiB of K/V, {free / GIB:.2f} GiB free")
    gen = torch.Generator(device=device).manual_seed(0)
    cache_shape = (num_blocks * BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = tables.view(sets, shape.batch, blocks_per_row)
    context_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    queries = [torch.randn(shape.batch, num_q_heads, head_dim, generator=gen, device=device, dtype=dtype)
               for _ in range(sets)]
    scale = head_dim ** -0.5
    passes = max(1, math.ceil(20 / sets))
    calls = [lambda s=s: paged_decode_attention(queries[s], key_cache, value_cache, tables[s], context_lens, scale,
                                                BLOCK_SIZE) for s in range(sets)] * passes
    result = {"sets": sets, "calls_per_pass": len(calls)}
    result["eager_s"] = seconds_per_call(calls, rounds=10, graph=False)  # also the warm-up before capture
    try:
        result["graph_s"] = seconds_per_call(calls, rounds=10, graph=True)
    except Exception as exc:  # noqa: BLE001 -- capture failed: the eager time stands in
        result["graph_error"] = one_line(exc)
    del calls
    torch.cuda.synchronize()

    # The torch fallback as the engine runs it (eagerly): gather each context's slots, one SDPA.
    try:
        positions = torch.arange(shape.context, device=device)
        mask = torch.ones(shape.batch, 1, 1, shape.context, dtype=torch.bool, device=device)
        slots = [(tables[s][:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
                 for s in range(sets)]
        fallback = [lambda s=s: decode_attention(queries[s], key_cache, value_cache, slots[s], mask, scale)
                    for s in range(sets)] * passes
        result["torch_s"] = seconds_per_call(fallback, rounds=3, graph=False)
    except Exception as exc:  # noqa: BLE001 -- out of memory, mostly: the kernel's row still stands
        result["torch_error"] = one_line(exc, 80)
    return result


def run_roofline(device: torch.device, tiny: bool) -> list[Row]:
    name = torch.cuda.get_device_name(device)
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    peak, peak_label = nominal_bandwidth(name)
    copy_bw, copy_bytes = copy_bandwidth(device)
    release_memory(device)
    rows = [Row("roofline", f"device copy of {copy_bytes / GIB:.1f} GiB (read + write)", f"{copy_bw / 1e12:.2f} TB/s",
                f"nominal {peak / 1e12:.2f} TB/s ({peak_label})" if peak else f"nominal n/a ({peak_label})",
                f"{copy_bw / peak:.0%}" if peak else "-",
                data={"copy_bytes_per_s": copy_bw, "nominal_bytes_per_s": peak, "device": name})]
    report_progress(rows[-1])
    batches, contexts = ((1, 8), (1024,)) if tiny else ((1, 8, 32, 128), (1024, 4096, 16384))
    heads = "{}q/{}kv x {}".format(*ROOFLINE_HEADS)
    element = ROOFLINE_DTYPE.itemsize
    for context in contexts:
        for batch in batches:
            shape = DecodeShape(batch, context)
            case = f"decode B={batch} ctx={context} ({heads}, {DTYPE_NAMES[ROOFLINE_DTYPE]})"
            try:
                timing = time_decode_shape(shape, device, l2_bytes, ROOFLINE_DTYPE)
            except torch.cuda.OutOfMemoryError as exc:
                rows.append(Row("roofline", case, f"skipped: {one_line(exc, 80)}", status="skipped"))
                timing = None
            except Exception as exc:  # noqa: BLE001 -- one shape's failure is its row's, not the run's
                rows.append(Row("roofline", case, f"error: {one_line(exc)}", status="error"))
                timing = None
            release_memory(device)
            if timing is None:
                report_progress(rows[-1])
                continue
            seconds = timing.get("graph_s", timing["eager_s"])
            bandwidth = shape.bytes_moved(element) / seconds
            measured = (f"{seconds * 1e6:.1f} us, {bandwidth / 1e12:.2f} TB/s"
                        + (f" (eager {timing['eager_s'] * 1e6:.1f} us)" if "graph_s" in timing
                           else f" (eager only: graph capture failed: {timing['graph_error'][:80]})"))
            if "torch_s" in timing:
                baseline = f"torch fallback {timing['torch_s'] * 1e6:.1f} us"
                speedup = f"{timing['torch_s'] / seconds:.1f}x"
            else:
                baseline, speedup = f"torch fallback: {timing.get('torch_error')}", "-"
            of_copy = bandwidth / copy_bw
            vs_roofline = f"{of_copy:.0%} of copy" + (f", {bandwidth / peak:.0%} of nominal" if peak else "")
            aim = f">= {ROOFLINE_AIM:.0%}: {'yes' if of_copy >= ROOFLINE_AIM else 'no'}" if context >= 1024 else "-"
            rows.append(Row("roofline", case, measured, baseline, speedup, vs_roofline, aim,
                            data={"batch": batch, "context": context, "bytes": shape.bytes_moved(element),
                                  "bytes_per_s": bandwidth, "fraction_of_copy": of_copy,
                                  "fraction_of_nominal": bandwidth / peak if peak else None, **timing}))
            report_progress(rows[-1])
    return rows


# ---- 3. end-to-end decode throughput ------------------------------------------------------------


def build_random_llama(folder: Path, device: torch.device) -> Path:
    """A random-weight bf16 Llama of Llama-3.2-1B's shape and a word-level tokenizer covering its
    whole vocabulary (so every generated id detokenizes), built once; reused if complete."""
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    print(f"building a random-weight Llama-3.2-1B-shaped model in {folder} (first use)...", flush=True)
    staging = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    vocab = {f"<t{i}>": i for i in range(LLAMA_3_2_1B["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<t0>", eos_token="<t1>",
                            bos_token="<t2>").save_pretrained(staging)
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.2B parameters on a CPU takes minutes
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_3_2_1B))
    model.to(device="cpu", dtype=torch.bfloat16).save_pretrained(staging)
    del model
    release_memory(device)
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder left by an interrupted build
    staging.replace(folder)
    return folder


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.max_tokens


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@dataclass
class Throughput:
    tokens_per_s: float
    startup_s: float  # load, profiling, graph capture
    warmup_s: float  # the first run of the workload (Triton compiles, allocator)
    runs: list[float]  # tok/s of each timed run
    note: str = ""


def best_of(reps: int, run: Callable[[], int], expected_tokens: int, device: torch.device) -> tuple[list[float], str]:
    rates, note = [], ""
    for _ in range(reps):
        synchronize(device)
        started = time.perf_counter()
        tokens = run()
        synchronize(device)
        rates.append(tokens / (time.perf_counter() - started))
        if tokens != expected_tokens:
            note = f"generated {tokens} of {expected_tokens} tokens"
    return rates, note


def run_engine(path: Path, workload: Workload, device: torch.device, reps: int, max_num_batched_tokens: int,
               **options) -> Throughput:
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)

    def run() -> int:
        return sum(len(o.token_ids) for o in llm.generate(workload.prompts, params))

    started = time.perf_counter()
    llm = LLM(str(path), device=str(device), dtype="bfloat16", max_num_seqs=len(workload.prompts),
              max_num_batched_tokens=max_num_batched_tokens,
              max_model_len=max(len(p) for p in workload.prompts) + workload.max_tokens,
              enable_prefix_caching=False, gpu_memory_utilization=0.9, **options)
    try:
        startup = time.perf_counter() - started
        started = time.perf_counter()
        run()
        warmup = time.perf_counter() - started
        rates, note = best_of(reps, run, workload.num_output_tokens, device)
    finally:
        llm.engine.core.close()  # its step thread holds the model; the caller releases the memory
    return Throughput(max(rates), startup, warmup, rates, note)


def load_hf_model(path: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device).eval()


def run_hf_continuous_batching(model, workload: Workload, device: torch.device, reps: int,
                               cuda_graphs: bool = False) -> Throughput:
    """transformers' own continuous batching through `generate_batch`, with sdpa: flash-attn is not
    assumed installed, and auto_switch_to_flash is off so it never looks for a Hub kernel. Run with
    its defaults for sdpa (no CUDA graphs) and with its CUDA graphs forced on: the engine's ratio is
    taken against the faster. The manager is kept between calls so the timed runs skip its set-up
    and warm-up, which the first (warm-up) run pays."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation_config = GenerationConfig(max_new_tokens=workload.max_tokens, do_sample=False, eos_token_id=-1,
                                         pad_token_id=0)
    cb_config = ContinuousBatchingConfig(auto_switch_to_flash=False, allow_block_sharing=False,
                                         **({"use_cuda_graph": True} if cuda_graphs else {}))

    def run() -> int:
        results = model.generate_batch(inputs=workload.prompts, generation_config=generation_config,
                                       continuous_batching_config=cb_config, persistent_manager=True)
        failed = [r.error for r in results.values() if r.error is not None]
        if len(results) != len(workload.prompts) or failed:
            raise RuntimeError(f"transformers returned {len(results)} of {len(workload.prompts)} requests"
                               + (f", first error: {failed[0]}" if failed else ""))
        return sum(len(r.generated_tokens) for r in results.values())

    try:
        started = time.perf_counter()
        run()
        warmup = time.perf_counter() - started
        rates, note = best_of(reps, run, workload.num_output_tokens, device)
    finally:
        model.destroy_cached_continuous_batching_manager()
        release_memory(device)
    return Throughput(max(rates), 0.0, warmup, rates, note)


def run_hf_generate(model, workload: Workload, device: torch.device, reps: int) -> Throughput:
    """Plain `generate` on the whole workload as one left-padded batch."""
    width = max(len(p) for p in workload.prompts)
    ids = torch.zeros(len(workload.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(workload.prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)

    @torch.inference_mode()
    def run(rows: int = len(workload.prompts), new: int = workload.max_tokens) -> int:
        out = model.generate(input_ids=ids[:rows], attention_mask=mask[:rows], max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        return (out.shape[1] - width) * rows

    started = time.perf_counter()
    run(rows=2, new=4)
    warmup = time.perf_counter() - started
    rates, note = best_of(reps, run, workload.num_output_tokens, device)
    return Throughput(max(rates), 0.0, warmup, rates, note)


def run_e2e(args, device: torch.device, notes: list[str]) -> list[Row]:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # Continuous batching logs through its own logger (a warning per persistent generate_batch call).
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    temporary = None
    if args.model:
        path, model_label = Path(args.model).expanduser(), f"model {args.model}"
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {args.model}: not a local checkpoint folder (no config.json)")
    else:
        if os.environ.get("ANTIPHON_CACHE"):
            root = Path(os.environ["ANTIPHON_CACHE"]) / "bench-models"
        else:
            root = temporary = Path(tempfile.mkdtemp(prefix="antiphon-gpu-bench-"))
        root.mkdir(parents=True, exist_ok=True)
        path = build_random_llama(root / "llama-3.2-1b-shape-random-bf16", device)
        model_label = "random-weight Llama-3.2-1B shape (bf16)"
    try:
        config = AutoConfig.from_pretrained(path)
        vocab = min(config.get_text_config().vocab_size, len(AutoTokenizer.from_pretrained(path)))
        num_prompts = args.num_prompts or (8 if args.tiny else 128)
        max_tokens = args.max_tokens or (32 if args.tiny else 256)
        workload = Workload(random_prompts(num_prompts, (128, 512), vocab, seed=0), max_tokens)
        header = (f"e2e: {model_label}, {num_prompts} prompts of 128-512 random tokens x {max_tokens} new tokens, "
                  f"greedy, EOS ignored, best of {args.reps} after a warm-up run")
        print(header, flush=True)
        notes.append(header)
        results: dict[str, Throughput | str] = {}
        engines = {
            "engine: Triton + CUDA graphs": {"attention_backend": "triton", "decode_graphs": "auto"},
            "engine: Triton, eager": {"attention_backend": "triton", "decode_graphs": "off"},
            "engine: torch attention, eager": {"attention_backend": "torch", "decode_graphs": "off"},
        }
        for name, options in engines.items():
            results[name] = measure(partial(run_engine, path, workload, device, args.reps,
                                            args.max_num_batched_tokens, **options), device)
            print(f"[e2e] {name}: {describe(results[name])}", flush=True)
        started = time.perf_counter()
        model = measure(lambda: load_hf_model(path, device), device)
        load_s = time.perf_counter() - started
        hf_runners = {
            "transformers continuous batching (sdpa)": run_hf_continuous_batching,
            "transformers continuous batching (sdpa, CUDA graphs)": partial(run_hf_continuous_batching,
                                                                             cuda_graphs=True),
            "transformers generate, padded batch (sdpa)": run_hf_generate,
        }
        if isinstance(model, str):
            results.update({name: model for name in hf_runners})
        else:
            for name, runner in hf_runners.items():
                results[name] = measure(partial(runner, model, workload, device, args.reps), device)
                if isinstance(results[name], Throughput):
                    results[name].startup_s = load_s
                print(f"[e2e] {name}: {describe(results[name])}", flush=True)
            del model
            release_memory(device)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    return e2e_rows(results)


def measure(run: Callable, device: torch.device):
    """run()'s value, or its failure as a one-line string; memory is released either way (after
    the exception, whose traceback holds the failed run's frames, is gone)."""
    try:
        return run()
    except torch.cuda.OutOfMemoryError as exc:
        return f"skipped: {one_line(exc, 100)}"
    except Exception as exc:  # noqa: BLE001 -- one configuration's failure is its row's, not the run's
        return f"error: {one_line(exc)}"
    finally:
        release_memory(device)


def describe(result: Throughput | str) -> str:
    if isinstance(result, str):
        return result
    text = (f"{result.tokens_per_s:,.0f} tok/s (start {result.startup_s:.1f} s, warm-up run {result.warmup_s:.1f} s)")
    return text + (f"; {result.note}" if result.note else "")


def e2e_rows(results: dict) -> list[Row]:
    """Ratios against the faster of transformers' continuous batching runs."""
    batching = {name: r for name, r in results.items() if name.startswith("transformers continuous batching")}
    measured = {name: r for name, r in batching.items() if isinstance(r, Throughput)}
    if measured:
        baseline_name = max(measured, key=lambda name: measured[name].tokens_per_s)
        base_rate = measured[baseline_name].tokens_per_s
        base_text = f"{baseline_name.removeprefix('transformers ')} {base_rate:,.0f} tok/s"
    else:
        base_rate = None
        base_text = "transformers CB: " + ("; ".join(str(r) for r in batching.values()) or "n/a")
    rows = []
    for name, result in results.items():
        if isinstance(result, str):
            rows.append(Row("e2e", name, result, base_text,
                            status="skipped" if result.startswith("skipped") else "error"))
            continue
        ratio = result.tokens_per_s / base_rate if base_rate else None
        aim = "-"
        if name.startswith("engine") and ratio is not None:
            aim = f">= {E2E_AIM:g}x: {'yes' if ratio >= E2E_AIM else 'no'}"
        rows.append(Row("e2e", name, describe(result), base_text, f"{ratio:.2f}x" if ratio else "-", "-", aim,
                        data=asdict(result)))
    return rows


# ---- the run -------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    columns = ("part", "case", "measured", "baseline", "vs baseline", "vs roofline", "aim")
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = (row.part, row.case, row.measured, row.baseline, row.vs_baseline, row.vs_roofline, row.aim)
        print("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")


def environment(device: torch.device) -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device"] = (f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / GIB:.0f} GiB, "
                          f"{props.multi_processor_count} SMs, L2 {getattr(props, 'L2_cache_size', 0) >> 20} MiB)")
    else:
        info["device"] = "CPU, Triton interpreter (TRITON_INTERPRET=1)"
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cuda:N; cpu only with --check-only")
    parser.add_argument("--check-only", action="store_true", help="only the kernel check (part 1)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes everywhere: the check in a CPU's interpreter, or a GPU smoke run")
    parser.add_argument("--skip-kernels", action="store_true", help="skip the kernel check")
    parser.add_argument("--skip-roofline", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--model", help="a local checkpoint folder for e2e (default: random Llama-3.2-1B shape)")
    parser.add_argument("--num-prompts", type=int, help="e2e prompts (default 128; 8 with --tiny)")
    parser.add_argument("--max-tokens", type=int, help="e2e new tokens per prompt (default 256; 32 with --tiny)")
    parser.add_argument("--reps", type=int, default=2, help="timed e2e runs after the warm-up run; best kept")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's step token budget")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.exit(2, "gpu.py: --reps must be at least 1\n")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.exit(2, f"gpu.py: unsupported --device {args.device!r}: cuda, cuda:N or cpu\n")
    if device.type == "cpu":
        if not args.check_only:
            parser.exit(2, "gpu.py: --device cpu runs only the kernel check: add --check-only (and --tiny)\n")
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.exit(2, "gpu.py: --device cpu runs the Triton kernels in the interpreter, which needs "
                           "TRITON_INTERPRET=1 set before start: TRITON_INTERPRET=1 python benchmarks/gpu.py "
                           "--check-only --tiny --device cpu\n")
    elif device.type == "cuda":
        if not torch.cuda.is_available():
            parser.exit(2, f"gpu.py: no CUDA GPU found (torch {torch.__version__}, CUDA build "
                           f"{torch.version.cuda or 'none'}); this benchmark needs an NVIDIA GPU. On a CPU only the "
                           "kernel check runs: TRITON_INTERPRET=1 python benchmarks/gpu.py --check-only --tiny "
                           "--device cpu\n")
        if os.environ.get("TRITON_INTERPRET") == "1":
            parser.exit(2, "gpu.py: TRITON_INTERPRET=1 would run the kernels in Triton's interpreter, not on the "
                           "GPU: unset it\n")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    else:
        parser.exit(2, f"gpu.py: unsupported --device {args.device!r}: cuda, cuda:N or cpu\n")
    args.device = device
    return args


def run_part(part: str, run: Callable[[], list[Row]], device: torch.device) -> list[Row]:
    """The part's rows; if it fails outside its own per-row handling, one error row instead, so
    the other parts' results still print."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 -- reported as the part's row; the exit status says it too
        return [Row(part, "the whole part", f"error: {one_line(exc, 300)}", status="error")]
    finally:
        release_memory(device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = environment(device)
    print(f"device: {info['device']}; torch {info['torch']} (CUDA {info['cuda']}), triton {info['triton']}",
          flush=True)
    rows: list[Row] = []
    notes: list[str] = []
    if not args.skip_kernels:
        rows += run_check(TINY_GRID if args.tiny else GPU_GRID, device)
        release_memory(device)
    check_failed = any(r.status == "fail" for r in rows)
    if check_failed:
        notes.append("kernel check failed: the benchmarks did not run")
    elif not args.check_only:
        if not args.skip_roofline:
            rows += run_part("roofline", lambda: run_roofline(device, args.tiny), device)
        if not args.skip_e2e:
            rows += run_part("e2e", lambda: run_e2e(args, device, notes), device)

    print(f"\nAntiphon GPU benchmark -- device: {info['device']}; torch {info['torch']} (CUDA {info['cuda']}), "
          f"triton {info['triton']}")
    for note in notes:
        print(note)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({**info, "notes": notes, "rows": [asdict(r) for r in rows]},
                                              indent=2, default=str))
    return 1 if any(r.status in ("fail", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
