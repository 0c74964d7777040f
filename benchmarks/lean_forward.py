"""The lean CPU forward (workers/cpu/lean_forward.py) against transformers' own modules, on the
default model in `--quantization auto`, in one process taking turns: a 300-token prompt step,
then its one-row decode steps on the Python forward (the C++ stack set aside, as before the
native library is built). Prints each step kind's median and the ratio.

    python benchmarks/lean_forward.py [--prompt-tokens 300] [--reps 6] [--threads 2]
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
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams
    from engine.request import Request
    from workers.cpu import native_library
    from workers.model_runner import ModelRunner

    native_library.wait_until_built(900)
    core = LLM(quantization="auto").engine.core
    runner = core.executor.runner
    lean = runner.lean
    if lean is None:
        raise SystemExit("the default model takes no lean forward here")
    seconds: dict[tuple[str, str], list[float]] = {}
    forward = ModelRunner._forward

    def timed(self, batch, states):
        kind = "prompt step" if batch.num_decodes < len(batch.ends) else "one-row decode step"
        started = time.perf_counter()
        out = forward(self, batch, states)
        seconds.setdefault((kind, "lean" if self.lean is not None else "modules"), []).append(
            time.perf_counter() - started)
        return out
    ModelRunner._forward = timed
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fresh = iter(range(100, 10**6))
    stack, lean.native = lean.native, None  # decode steps on the Python forward
    for rep in range(args.reps + 1):  # the first round warms both up
        for use_lean in ((True, False) if rep % 2 else (False, True)):
            runner.lean = lean if use_lean else None
            prompt = [next(fresh) % 40000 + 100 for _ in range(args.prompt_tokens)]
            core.add_request(Request(f"{rep}-{use_lean}", prompt, params))
            while core.has_unfinished_requests:
                core.step()
        if rep == 0:
            seconds.clear()
    lean.native, runner.lean = stack, lean
    for kind in ("prompt step", "one-row decode step"):
        modules = statistics.median(seconds[(kind, "modules")]) * 1000
        fast = statistics.median(seconds[(kind, "lean")]) * 1000
        print(f"{kind}: lean {fast:.1f} ms, modules {modules:.1f} ms, {modules / fast:.2f}x")


if __name__ == "__main__":
    main()
