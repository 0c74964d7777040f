"""Decode attention on the CPU: the native kernel that reads the paged cache in place
(workers/cpu/csrc/native_attention.cpp) against the torch path it replaces in the 4-bit modes
(paged_attention.decode_attention: each row's context gathered with index_select, then one
SDPA call over the padded batch, masked where lengths differ).

The default model's heads (SmolLM2-135M: 9 query heads sharing 3 KV heads of 64), 30 layers
each with its own cache (so a pass reads the contexts from memory, as a step does), contexts
scattered over 16-token blocks in random order, each row's length drawn in [L/2, L]. Prints
microseconds per layer, best of the repetitions, and the ratio, on torch's threads (all cores
by default). Per layer only: the torch path also builds each row's slot list on the host
once a step, not counted here.

    python benchmarks/native_attention.py [--rows 1 4 16] [--contexts 128 512 2048] [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


def make_step(rows: int, context: int, generator: torch.Generator) -> dict:
    blocks_per_row = -(-context // BLOCK)
    num_blocks = rows * blocks_per_row + 1
    lengths = torch.randint(max(1, context // 2), context + 1, (rows,), generator=generator)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0: padding
    positions = torch.arange(context)
    tables = order[:rows * blocks_per_row].view(rows, blocks_per_row)
    # What the torch path reads: each row's slots, padded with slot 0 past its length.
    slots = tables[:, positions // BLOCK] * BLOCK + positions % BLOCK
    slots[positions[None, :] >= lengths[:, None]] = 0
    caches = [(torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=generator),
               torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=generator)) for _ in range(LAYERS)]
    width = int(lengths.max())
    slots = slots[:, :width].contiguous()
    mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :]
    return {"q": torch.randn(rows, HEADS, HEAD_DIM, generator=generator), "caches": caches, "slots": slots,
            "tables": tables, "lengths": lengths, "mask": None if bool(mask.all()) else mask}


def pass_us(step: dict, kind: str) -> float:
    from workers.cpu.native_attention import attend
    from workers.paged_attention import decode_attention

    scale = HEAD_DIM ** -0.5
    start = time.perf_counter()
    for keys, values in step["caches"]:
        if kind == "native":
            attend(step["q"], keys, values, step["tables"], step["lengths"], BLOCK, scale)
        else:
            decode_attention(step["q"], keys, values, step["slots"], step["mask"], scale)
    return (time.perf_counter() - start) / LAYERS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Each (rows, context) allocates 30 layers of caches: 16 x 2048 ~1.5 GB.
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    from workers.cpu import native_library

    if not native_library.wait_until_built(600) or not torch.ops.antiphon_cpu.decode_attention_supported(HEAD_DIM):
        raise SystemExit("the native decode attention needs the native library and AVX-512F on this CPU")
    generator = torch.Generator().manual_seed(0)
    print(f"decode attention, us per layer (best of {args.reps}; {HEADS} query heads, {KV_HEADS} KV heads of "
          f"{HEAD_DIM}, {torch.get_num_threads()} threads)")
    print("| rows | context | native | gather + SDPA | SDPA / native |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        for context in args.contexts:
            step = make_step(rows, context, generator)
            best = {"native": float("inf"), "torch": float("inf")}
            pass_us(step, "native"), pass_us(step, "torch")  # warm-up
            for _ in range(args.reps):
                for kind in best:
                    best[kind] = min(best[kind], pass_us(step, kind))
            print(f"| {rows} | {context} | {best['native']:.1f} | {best['torch']:.1f} | "
                  f"{best['torch'] / best['native']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
