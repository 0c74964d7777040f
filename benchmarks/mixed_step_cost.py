"""What it costs to keep a decoding stream's row on the 4-bit kernel in a step that computes
another request's prompt (workers/step_rows.py), against the rule before it: every row of such a
step on the bfloat16 copy.

In one process with the default model (`--quantization auto`): a stream decodes, then a prompt
of --prompt-tokens arrives and the step that computes it (beside the stream's next token) is
timed, the two rules taking turns; fresh token ids each time, so nothing comes from the prefix
cache. Prints the medians and their ratio.

    python benchmarks/mixed_step_cost.py [--prompt-tokens 300] [--reps 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams
    from engine.request import Request
    from workers import cpu_int4, native_decode, step_rows

    native_decode.wait_until_built(900)
    core = LLM(quantization="auto").engine.core
    split = step_rows.generated_rows

    def all_on_the_copy(rows: int) -> int:  # the rule before: no generated rows in a prompt step
        return rows if not step_rows.in_prompt_step() else 0

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    times: dict[str, list[float]] = {"every row on the copy (before)": [], "generated rows on the kernel": []}
    fresh = iter(range(100, 10**6))
    for rep in range(args.reps + 1):  # the first round warms both up
        for rule, seconds in times.items():
            cpu_int4.generated_rows = split if "kernel" in rule else all_on_the_copy
            stream = [next(fresh) for _ in range(40)]
            core.add_request(Request(f"stream-{rep}-{len(seconds)}-{rule}", stream, params))
            core.step()  # its prompt
            core.step()  # it decodes
            prompt = [next(fresh) % 40000 + 100 for _ in range(args.prompt_tokens)]
            core.add_request(Request(f"prompt-{rep}-{len(seconds)}-{rule}", prompt, params))
            started = time.perf_counter()
            core.step()  # the prompt beside the stream's next token
            if rep:
                seconds.append(time.perf_counter() - started)
            while core.has_unfinished_requests:
                core.step()
    cpu_int4.generated_rows = split
    medians = {rule: statistics.median(seconds) * 1000 for rule, seconds in times.items()}
    for rule, ms in medians.items():
        print(f"{rule}: {ms:.1f} ms (median of {args.reps})")
    before, after = medians.values()
    print(f"ratio: {after / before:.3f}x the step before")


if __name__ == "__main__":
    main()
