"""Antiphon on a CPU against its peers, on the default model (SmolLM2-135M), in one run.

Engines, taking turns within every repetition (this machine's speed drifts over minutes):
  - Antiphon exact (--quantization none: float32 on the native float32 product where the CPU has
    AVX-512F, else oneDNN-packed; greedy parity with transformers)
  - Antiphon default CPU mode (--quantization auto: what `antiphon serve` runs here)
  - llama.cpp through its own tools on the package's own Q4_1 GGUF (benchmarks/llama_cpp_binaries.py):
    `llama-bench` for one stream, `llama-batched-bench` for 16 streams decoded together, built
    from the source vendored in llama-cpp-python into $ANTIPHON_CACHE/peers on first use (two
    builds, with and without its AMX code; minutes each; never in CI); each figure is the faster
    build's
  - transformers `generate` (float32, sdpa), one stream only

Measured, median over the repetitions, the same chat token ids for every engine:
  one stream: decode tok/s after the first token of a 128-token greedy answer to a chat turn,
  and that turn's time to first token; prefill of 500 tokens (tok/s; fresh random ids of that
  length for every engine and round, so no cache hit); 16 streams x 128 tokens, total tok/s
  (their prompts' prefill included) and decode tok/s once every stream has its first token.
llama.cpp's tools cannot run Antiphon's exact workload; where they differ (the report says it too):
  - one-stream decode: `llama-bench -n 128 -d CHAT_LEN`, random tokens fed after a context as long
    as the chat turn, none sampled;
  - time to first token: a `llama-bench` prefill of the chat turn's length from an empty cache
    (Antiphon's turn finds its system prompt in the prefix cache after the first round);
  - prefill: `llama-bench -p 500`, its own random ids;
  - 16 streams: `llama-batched-bench`, 16 prompts of random tokens as long as the chat prompts,
    all prefilled in one batch, then 127 decode steps for all 16 at once (the prompts' logits give
    each stream its first token) on random tokens; its own figures count prompt tokens as output,
    so the table's are recomputed from its timings as Antiphon's are counted;
  - llama.cpp is not timed in the warm-up round (every tool run is a fresh process with its own
    warm-up run), and it has no startup figure.
Then: the float32 bandwidth limit (memory read GB/s measured here / float32 bytes read per
token), the modes' perplexity (benchmarks/perplexity.py), and the engines' startup time.

    python benchmarks/cpu_peers.py               # the README's table
    python benchmarks/cpu_peers.py --quick       # a smoke run (2 repetitions, short answers)
    python benchmarks/cpu_peers.py --no-llama-cpp
"""

from __future__ import annotations

import argparse
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
from engine.checkpoint import ensure_default_model  # noqa: E402

from benchmarks import llama_cpp_binaries  # noqa: E402

CHAT_TURN = "Tell me about the history of Paris, from its founding to today."


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

    from workers.cpu.linear_modes import auto_serves_int4, resolve_quantization

    requested = os.environ.get("ANTIPHON_QUANTIZATION", "auto")
    default_mode = resolve_quantization(requested, torch.device("cpu"))
    if requested == "auto" and auto_serves_int4(default_mode):
        default_mode = f"auto: int4 where the weights are 4-bit, else {default_mode}"
    path = ensure_default_model()
    # First, while no engine holds memory or threads: a new process's startup, both caches.
    fresh_process = {cache: fresh_process_startup(requested, cache) for cache in ("cold", "warm")}
    engines: dict[str, object] = {}
    startup: dict[str, float] = {}
    engines["exact"], startup["exact"] = timed_load(lambda: LLM(quantization="none"))
    engines["default"], startup["default"] = timed_load(lambda: LLM(quantization=requested))
    # Timed steps run the C++ decode stack, as a server's do once it is built.
    from workers.cpu import native_library

    native_library.wait_until_built(900)
    llama_builds = {} if args.no_llama_cpp else llama_cpp_binaries.ensure_builds()
    hf, startup["transformers"] = timed_load(lambda: AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval())

    tokenizer = engines["exact"].tokenizer
    chat = engines["exact"].apply_chat_template([{"role": "user", "content": CHAT_TURN}])
    rng = random.Random(0)
    vocab = len(tokenizer)
    results: dict[str, dict[str, list[float]]] = {}
    llama_build_used: dict[str, list[str]] = {}  # metric -> the llama.cpp build of each round's figure

    def record(engine: str, metric: str, value: float) -> None:
        results.setdefault(engine, {}).setdefault(metric, []).append(value)

    bandwidth_data = torch.randn(1 << 28)
    bandwidths = []
    for rep in range(reps + 1):  # the first round warms every engine up and is not counted
        warm = rep > 0
        if warm:
            bandwidths.append(memory_bandwidth_gbs(bandwidth_data))
        prefill_prompts = {name: [rng.randrange(100, vocab) for _ in range(prefill_len)]
                           for name in ("exact", "default")}
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
            elif name == "llama.cpp" and llama_builds and warm:
                figures = llama_cpp_binaries.fastest(llama_cpp_binaries.measure(
                    llama_builds, llama_cpp_binaries.gguf_path(), args.threads, generated=max_tokens,
                    streams=streams, chat_len=len(chat), prefill_len=prefill_len,
                    batch_prompt_len=round(statistics.mean(map(len, batch)))))
                for metric, figure in figures.items():
                    record(name, metric, figure.value)
                    llama_build_used.setdefault(metric, []).append(figure.build)
                continue
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
           streams, prefill_len, args.threads, llama_build_used)


def report(results, startup, fresh_process, default_mode, bandwidth, bytes_per_token, limit, perplexities, reps, max_tokens,
           streams, prefill_len, threads, llama_build_used) -> None:
    def med(engine, metric):
        values = results.get(engine, {}).get(metric)
        return statistics.median(values) if values else None

    def cell(value, fmt="{:.1f}"):
        return "-" if value is None else fmt.format(value)

    names = {"exact": "Antiphon exact (fp32)", "default": f"Antiphon default CPU mode ({default_mode})",
             "llama.cpp": "llama.cpp (Q4_1 GGUF, its own tools)", "transformers": "transformers generate (fp32)"}
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
    print("| startup (s; model already converted) | " + " | ".join(cell(startup.get(n)) for n in present) + " |")
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
              f"{streams} streams {med('default', 'batch') / med('llama.cpp', 'batch'):.2f}x (aim: >= 2; decode "
              f"alone {med('default', 'batch_decode') / med('llama.cpp', 'batch_decode'):.2f}x)")
        used = "; ".join(f"{metric} {', '.join(f'{b} {builds.count(b)}/{len(builds)}' for b in sorted(set(builds)))}"
                         for metric, builds in llama_build_used.items())
        print(f"llama.cpp's figures: the faster of its builds each round ({used}). Not like for like: its "
              f"one-stream decode feeds random tokens after a context as long as the chat turn; its time to first "
              f"token is a prefill of that length from an empty cache; its {streams} streams are "
              f"`llama-batched-bench`'s random-token prompts prefilled in one batch, then decoded together.")
    decode_alone = ""
    if med("exact", "batch_decode") is not None and med("default", "batch_decode") is not None:
        decode_alone = (f"; decode alone on both sides: exact {med('exact', 'batch_decode') / exact:.2f}x, default "
                        f"{med('default', 'batch_decode') / med('default', 'decode'):.2f}x")
    print(f"{streams} streams vs one stream: exact {med('exact', 'batch') / exact:.2f}x, "
          f"default {med('default', 'batch') / med('default', 'decode'):.2f}x (aim: > 6; {streams} streams' total, "
          f"their prompts' prefill included, over one stream's decode){decode_alone}")
    if perplexities:
        from workers.cpu.linear_modes import AUTO_PERPLEXITY_BOUND

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
            "from workers.cpu import native_library; ready = native_library.wait_until_built(900); "
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
