"""Exact mode's float32 products: the native kernel against oneDNN's packed one.

Over the default model's 211 linear layers' shapes as an exact-mode step calls them
(SmolLM2-135M: per layer q 576 -> 576, k and v 576 -> 192, o 576 -> 576, gate and up 576 ->
1536, down 1536 -> 576; the output matrix 576 -> 49152), each its own weights, so a pass reads
them from memory as a decode step does (538 MB). For each row count: the native product
(workers/cpu/csrc/float32_product.cpp, where this CPU has AVX-512F) and oneDNN's packed float32
product (packed_linear.py, what exact mode used before, and uses where the native one does
not run), taking turns, best of the repetitions; and the read bandwidth of a 1 GiB sum, as
benchmarks/cpu_peers.py measures it, for the one-row pass to be read against.

    python benchmarks/float32_products.py [--rows 1 4 16 64 512] [--reps 5]
"""

from __future__ import annotations

import argparse

import torch
from cpu_peers import memory_bandwidth_gbs  # beside this script
from int4_kernels import best_pass_times

SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
OUTPUT_MATRIX = (576, 49152)
LAYERS = 30


def build_layers(native: bool, layers_count: int = LAYERS) -> list[dict]:
    from workers.cpu.float32_linear import Float32Linear
    from workers.cpu.packed_linear import PackedLinear

    generator = torch.Generator().manual_seed(0)
    layers = []
    for inputs, outputs in SHAPES * layers_count + [OUTPUT_MATRIX]:
        linear = torch.nn.Linear(inputs, outputs, bias=False)
        linear.weight.data = torch.randn(outputs, inputs, generator=generator) * 0.05
        layer = {"inputs": inputs, "oneDNN": PackedLinear(linear)}
        if native:
            layer["native"] = Float32Linear(linear)
        layers.append(layer)
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (the model's 30)")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the 1 GiB read bandwidth line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from workers.cpu import native_library

    native = native_library.float32_product_available()
    layers = build_layers(native, args.layers)
    megabytes = sum(i * o for i, o in SHAPES * args.layers + [OUTPUT_MATRIX]) * 4 / 1e6
    kinds = (["native"] if native else []) + ["oneDNN"]
    print(f"{len(layers)} products ({megabytes:.0f} MB of float32 weights), {args.threads} threads, best of "
          f"{args.reps}, ms per pass{'' if native else ' (no native product here: AVX-512F and the native library)'}\n")
    print("| rows | " + " | ".join(kinds) + (" | oneDNN / native | native GB/s |" if native else " |"))
    # From 256 rows "native" is oneDNN's product on a plain copy (float32_product.cpp).
    print("|---" * (len(kinds) + (3 if native else 1)) + "|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
        best = best_pass_times(layers, kinds, inputs, args.reps)
        cells = [f"{best[kind] * 1000:.2f}" for kind in kinds]
        if native:
            cells += [f"{best['oneDNN'] / best['native']:.2f}x", f"{megabytes / 1000 / best['native']:.1f}"]
        print(f"| {rows} | " + " | ".join(cells) + " |")
    if not args.no_bandwidth:
        bandwidth = memory_bandwidth_gbs(torch.randn(1 << 28))
        print(f"\nread bandwidth (cpu_peers.py's: a 1 GiB float32 sum, median of 3): {bandwidth:.1f} GB/s")


if __name__ == "__main__":
    main()
