"""The 4-bit CPU kernels against each other and against oneDNN's bfloat16 product.

Over the default model's 210 linear layers' shapes as a decode step calls them, 120 products
(SmolLM2-135M: per layer q/k/v fused 576 -> 960, o 576 -> 576, gate/up fused 576 -> 3072, down
1536 -> 576), each its own weights, so a pass reads them from memory as a decode step does.
For each row count: the native kernel (workers/cpu/csrc/int4_product.cpp, VNNI or AVX2, where this
CPU has one), torch's `_weight_int4pack_mm_for_cpu` and oneDNN's dense product of the same
weights (what prompt rows use: bfloat16 where oneDNN has a bfloat16 product, else float32);
each pass calls the 120 products from Python, the kinds taking turns, best of the repetitions.

    python benchmarks/int4_kernels.py [--rows 1 8 16 32] [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (inputs, outputs) per layer
LAYERS = 30


def build_layers(native: bool, dense_dtype: torch.dtype) -> list[dict]:
    from workers.cpu.int4 import quantize_int4
    from workers.cpu.packed_linear import PackedLinear

    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        for inputs, outputs in SHAPES:
            quantized = quantize_int4(torch.randn(outputs, inputs, generator=generator) * 0.05)
            dense = torch.nn.Linear(inputs, outputs, bias=False)
            dense.weight.data = quantized.kernel_weights()
            # The dense peer: what auto serves a layer off the 4-bit grid as.
            layer = {"inputs": inputs, "torch": quantized.product(native=False),
                     "dense": PackedLinear(dense, dense_dtype)}
            if native:
                layer["native"] = quantized.product(native=True)
            layers.append(layer)
    return layers


def time_pass(layers: list[dict], kind: str, inputs: dict[int, torch.Tensor]) -> float:
    started = time.perf_counter()
    for layer in layers:
        layer[kind](inputs[layer["inputs"]])
    return time.perf_counter() - started


def best_pass_times(layers: list[dict], kinds: list[str], inputs: dict[int, torch.Tensor], reps: int) -> dict:
    """Seconds of each kind's best pass over `layers` (each a dict: "inputs" -> width, kind ->
    product), the kinds taking turns; a first pass of each warms up and is not counted.
    (benchmarks/float32_products.py times its products this way too.)"""
    best = {kind: float("inf") for kind in kinds}
    for rep in range(reps + 1):
        for kind in kinds:
            elapsed = time_pass(layers, kind, inputs)
            if rep:
                best[kind] = min(best[kind], elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from workers.cpu import int4
    from workers.cpu.packed_linear import can_pack_bf16

    native = int4.native_kernel_available()
    dense_dtype = torch.bfloat16 if can_pack_bf16() else torch.float32
    layers = build_layers(native, dense_dtype)
    kinds = (["native"] if native else []) + ["torch", "dense"]
    print(f"{len(layers)} products (the default model's 210 layers, q/k/v and gate/up fused), {args.threads} "
          f"threads, best of {args.reps}, ms per "
          f"pass{'' if native else ' (no native kernel here: AVX-512 VNNI or AVX2, and the native library)'}; "
          f"dense: oneDNN {str(dense_dtype).removeprefix('torch.')}\n")
    print("| rows | " + " | ".join(kinds) + " | " + " | ".join(f"dense / {k}" for k in kinds[:-1]) + " |")
    print("|---" * (1 + 2 * len(kinds) - 1) + "|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
        best = best_pass_times(layers, kinds, inputs, args.reps)
        ratios = [f"{best['dense'] / best[kind]:.2f}x" for kind in kinds[:-1]]
        print(f"| {rows} | " + " | ".join(f"{best[kind] * 1000:.2f}" for kind in kinds) + " | " + " | ".join(ratios)
              + " |")


if __name__ == "__main__":
    main()
