"""A/B of two commits on the CPU: Antiphon's decode speed at one stream and at 16 streams, in
both CPU modes, each commit in processes of its own, taking turns (this machine's speed drifts
over minutes, so each round runs both commits back to back, in alternating order).

The base commit is checked out once into $ANTIPHON_CACHE/ab/<commit> (a git worktree); the
other side is this checkout as it is, or with --head a commit checked out the same way (so
that editing this checkout during a run does not change what it measures). Each process loads
the default model, waits for its checkout's native library (a first run builds it, minutes on
two cores), warms up, then times: one greedy stream of --max-tokens (decode tok/s after the
first token; the better of two) and 16 streams of as many tokens (total tok/s, prompts included). Prints each figure's median per commit and the ratio
head / base. A change that is structure only should show ratios within the noise (the spread
of a commit's own rounds, printed beside it).

    python benchmarks/ab_commits.py --base 35b7f45 [--head HEAD] [--reps 3] [--modes auto none]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Runs inside each checkout; only the engine's public API, which both commits share.
MEASURE = r"""
import json, sys, time
import torch
torch.set_num_threads({threads})
try:
    from workers.cpu import native_library
except ImportError:
    from workers import native_decode as native_library
native_library.wait_until_built(1800)
from engine import LLM, SamplingParams

llm = LLM(quantization={mode!r})
tokens = {max_tokens}
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
prompt = [(7 * i) % 5000 + 100 for i in range(60)]
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up

def one_stream(ids):
    first = None
    for out in llm.stream([ids], params):
        if first is None and out.token_ids:
            first = time.perf_counter()
    return (tokens - 1) / (time.perf_counter() - first)

def streams(prompts):
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started)

# The better of two: a single stream's speed swings with what else the machine does.
one = max(one_stream([p + 1 for p in prompt]), one_stream([p + 2 for p in prompt]))
sixteen = streams([[(p + 13 * s) % 5000 + 100 for p in prompt] for s in range(16)])
print("RESULT " + json.dumps({{"1 stream decode tok/s": one, "16 streams total tok/s": sixteen}}))
"""


def checkout_of(revision: str) -> Path:
    from engine.checkpoint import cache_dir

    commit = subprocess.run(["git", "rev-parse", revision], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    folder = cache_dir() / "ab" / commit[:12]
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(folder), commit], cwd=ROOT, check=True,
                       capture_output=True)
    return folder


def measure(checkout: Path, mode: str, max_tokens: int, threads: int) -> dict[str, float]:
    code = MEASURE.format(threads=threads, mode=mode, max_tokens=max_tokens)
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{checkout} ({mode}) failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--head", help="a commit to measure instead of this checkout as it is")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["auto", "none"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    sides = {"base": checkout_of(args.base), "head": checkout_of(args.head) if args.head else ROOT}
    results: dict[tuple[str, str, str], list[float]] = {}
    for rep in range(args.reps):
        order = ["base", "head"] if rep % 2 == 0 else ["head", "base"]
        for mode in args.modes:
            for side in order:
                for metric, value in measure(sides[side], mode, args.max_tokens, args.threads).items():
                    results.setdefault((mode, metric, side), []).append(value)
        # The table so far after every round: a run cut short still says what it measured.
        print(f"after round {rep + 1} of {args.reps}:", flush=True)
        print_table(results, args.modes, args.base, args.head or "this checkout")


def print_table(results: dict[tuple[str, str, str], list[float]], modes: list[str], base_name: str,
                head_name: str) -> None:
    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    print(f"| mode | figure | base {base_name} | head {head_name} | head / base |")
    print("|---|---|---|---|---|")
    for mode in modes:
        for metric in ("1 stream decode tok/s", "16 streams total tok/s"):
            base, head = results[(mode, metric, "base")], results[(mode, metric, "head")]
            print(f"| {mode} | {metric} | {spread(base)} | {spread(head)} | "
                  f"{statistics.median(head) / statistics.median(base):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
