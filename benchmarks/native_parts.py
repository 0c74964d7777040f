"""The native RMSNorm and output-layer rescoring (workers/cpu/csrc/rms_norm.cpp, rescore_top.cpp)
against torch's, in one process: two engines of the same mode, one built with them and one
without (model_loader.choose_native_parts decides at load), taking turns inside each round.

Greedy streams of the default model, 128 tokens each (chat prompts); prints each engine's
median total tok/s for one stream and for 16, the ratio, and how many answers the two
engines gave alike (the native norm rounds differently: rounding-level differences may
move a greedy answer in the 4-bit modes; exact mode's should not move), over every round and
stream count.

    python benchmarks/native_parts.py [--mode auto|none] [--rounds 6] [--streams 1 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def native_parts(model: torch.nn.Module) -> str:
    """What a loaded model runs: its norms' and its output layer's kernels."""
    from workers.cpu.output_layer import RescoredOutputLayer
    from workers.cpu.rms_norm import FusedRMSNorm

    norms = {module.native for module in model.modules() if isinstance(module, FusedRMSNorm)}
    output = model.get_output_embeddings()
    rescore = output.native_rescore if isinstance(output, RescoredOutputLayer) else None
    return f"native norms {sorted(norms)}, native rescoring {rescore}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="auto", help="--quantization of both engines")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds, after one warm-up round")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from engine import LLM, SamplingParams
    from workers.cpu import native_library

    if not native_library.wait_until_built(native_library.NATIVE_BUILD_WAIT_SECONDS):
        parser.error("the native library did not build here: nothing to compare")
    saved = native_library.rms_norm_available, native_library.rescore_top_available
    native_library.rms_norm_available = native_library.rescore_top_available = lambda: False
    try:
        engines = {"torch's": LLM(quantization=args.mode)}
    finally:
        native_library.rms_norm_available, native_library.rescore_top_available = saved
    engines["native"] = LLM(quantization=args.mode)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rates = {name: {n: [] for n in args.streams} for name in engines}
    same, compared = 0, 0
    for round_index in range(args.rounds + 1):
        answers = {}
        order = list(engines) if round_index % 2 else list(reversed(engines))
        for name in order:
            llm = engines[name]
            for n in args.streams:
                prompts = [llm.apply_chat_template([{"role": "user", "content": f"Story {round_index}-{i}: tell me "
                                                     "about a cat who found a map."}]) for i in range(n)]
                started = time.perf_counter()
                outputs = llm.generate(prompts, params)
                elapsed = time.perf_counter() - started
                if round_index:
                    rates[name][n].append(sum(len(o.token_ids) for o in outputs) / elapsed)
                answers.setdefault(name, []).extend(o.token_ids for o in outputs)
        same += sum(a == b for a, b in zip(answers["torch's"], answers["native"]))
        compared += len(answers["native"])
    print(f"--quantization {args.mode}; {args.rounds} rounds, medians, total tok/s")
    for name, llm in engines.items():
        print(f"{name} engine: {native_parts(llm.engine.core.executor.model)}")
    print("| streams | torch's norm and rescoring | native | native / torch's |\n|---|---|---|---|")
    for n in args.streams:
        old, new = statistics.median(rates["torch's"][n]), statistics.median(rates["native"][n])
        print(f"| {n} | {old:.1f} | {new:.1f} | {new / old:.2f}x |")
    print(f"greedy answers alike: {same} of {compared}")


if __name__ == "__main__":
    main()
