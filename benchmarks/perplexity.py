"""Perplexity of the default model on a fixed English text, per CPU mode (--quantization).

The text (benchmarks/data/english.txt, written for this repo) is scored in windows of
`--window` tokens; each mode converts the same float32 checkpoint with the engine's own code
(workers/cpu/linear_modes.py), so the numbers say what a mode costs in quality. `--kv-cache-dtype
bfloat16` scores the modes with their keys and values rounded as a bfloat16 KV cache holds
them (workers/kv_cache_dtype.py).

    python benchmarks/perplexity.py
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

TEXT = Path(__file__).parent / "data" / "english.txt"


def attention_over_rounded_keys(dtype: torch.dtype) -> str:
    """The name of an attention (registered with transformers) that is its SDPA over keys and
    values rounded to `dtype`, as a KV cache of that dtype holds them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = (t.to(dtype).to(t.dtype) for t in (key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    from workers.kv_cache_dtype import name

    registered = f"sdpa_over_{name(dtype)}_keys"
    AttentionInterface.register(registered, attention)
    return registered


def load_text_model(mode: str, kv_cache_dtype: str = "auto"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.checkpoint import ensure_default_model
    from workers.cpu import native_library
    from workers.cpu.linear_modes import prepare_linear_layers
    from workers.model_loader import choose_native_parts

    # The native kernels as a served model finds them (models with native layers wait for them).
    native_library.wait_until_built(native_library.NATIVE_BUILD_WAIT_SECONDS)
    path = ensure_default_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    if mode == "auto":
        from workers.cpu.linear_modes import resolve_quantization
        resolved = resolve_quantization("auto", torch.device("cpu"))
        prepare_linear_layers(model, resolved, int4_where_exact=True)
    else:
        prepare_linear_layers(model, mode)
    # The engine's norms and output rescoring (workers/model_loader.py).
    choose_native_parts(model)
    # And its KV cache's dtype.
    from workers.kv_cache_dtype import resolve_kv_cache_dtype

    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.float32, torch.device("cpu"), "torch")
    if kv_dtype != torch.float32:
        model.set_attn_implementation(attention_over_rounded_keys(kv_dtype))
    return model, AutoTokenizer.from_pretrained(path), kv_dtype


@torch.inference_mode()
def perplexity(model, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) over every token after the first of each window."""
    total_nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = torch.tensor([token_ids[start:start + window + 1]])
        if chunk.shape[1] < 2:
            break
        logits = model(chunk[:, :-1]).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum")
        total_nll += float(nll)
        count += chunk.shape[1] - 1
    return math.exp(total_nll / count)


def measure(modes: list[str], window: int, kv_cache_dtype: str = "auto") -> dict[str, tuple[float, str]]:
    """mode -> (perplexity, the KV cache's dtype when served), for the modes this CPU serves
    (the engine refuses the others: bf16 and int8 without a bfloat16 product, say)."""
    from workers.cpu.linear_modes import resolve_quantization
    from workers.cpu.row_layout import KernelRowLimits, StepRows
    from workers.forward_context import set_forward_context
    from workers.kv_cache_dtype import name

    results = {}
    for mode in modes:
        try:
            resolve_quantization(mode, torch.device("cpu"))
        except ValueError as refused:
            print(f"{mode}: not measured, this CPU does not serve it ({refused})", flush=True)
            continue
        model, tokenizer, kv_dtype = load_text_model(mode, kv_cache_dtype)
        token_ids = tokenizer(TEXT.read_text())["input_ids"]
        # 4-bit layers run their copy above a kernel's row limit (workers/cpu/row_layout.py);
        # scoring whole windows as generated rows on the 4-bit kernel instead measures what
        # decoding one stream uses.
        on_the_kernel = StepRows(limits=KernelRowLimits(torch_int4=window, native_int4=window))
        with set_forward_context(rows=on_the_kernel):
            results[mode] = perplexity(model, token_ids, window), name(kv_dtype)
        del model
    return results


def main() -> None:
    from workers.cpu.linear_modes import QUANTIZATION_MODES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16"], default="auto",
                        help="score with keys and values as a KV cache of this dtype holds them (auto: the model's)")
    parser.add_argument("--int4-kernel", choices=["process", "native", "torch"], default="process",
                        help="the 4-bit layers' kernel (int4.py): the one serving would use, or either")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from workers.cpu import int4

    if args.int4_kernel != "process":
        forced = args.int4_kernel == "native"
        if forced and not int4.native_kernel_available():
            parser.error("the native 4-bit kernel is not available here (AVX-512 VNNI or AVX2, and the native library)")
        int4.native_kernel_available = lambda wait=True: forced
    kernel = "native" if int4.native_kernel_available() else "torch's"
    started = time.perf_counter()
    from workers.cpu.linear_modes import resolve_quantization

    servable = []
    for mode in [*QUANTIZATION_MODES, "auto"]:
        try:
            resolve_quantization(mode, torch.device("cpu"))
            servable.append(mode)
        except ValueError as refusal:
            print(f"{mode}: not measured, the server refuses it here ({refusal})")
    results = measure(servable, args.window, args.kv_cache_dtype)
    print("| mode | KV cache | perplexity | vs none |\n|---|---|---|---|")
    for mode, (value, kv_dtype) in results.items():
        print(f"| {mode} | {kv_dtype} | {value:.3f} | {value / results['none'][0]:.3f}x |")
    print(f"\n{TEXT.name}, windows of {args.window} tokens, 4-bit layers on {kernel} kernel; "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
