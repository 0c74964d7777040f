"""Omni benchmark: what the thinker's prefix cache (KV and hidden-state rows, seed 002) buys at a
~95% prefix hit, for a text, an image and an audio prompt. One run prints one table; every
ratio is against the cache-off run of the same prompt in the same run.

    python benchmarks/omni.py            # the full run (about 2 minutes on 2 quiet cores)
    python benchmarks/omni.py --quick    # tiny sizes, to check that the script runs

The model is a random-weight Qwen2.5-Omni (the real architecture, transformers' classes, all
three stages) with the thinker scaled down and its towers kept at Qwen2.5-Omni-7B's
proportions: the vision tower and the audio tower about a third of the thinker's width, their
depth the thinker's (32 blocks beside 28 layers there). It speaks no real words. Built once
into the cache folder ($ANTIPHON_CACHE or ~/.cache/antiphon, under models/).

Each prompt is a shared context (a text, or the same text before a 448x448 image or a 10 s
clip) and a short question that differs each time. Both engines keep the talker's rows
(omni_speech: the hidden-state store is written every step). Cache on: prefix cache and
global encoder cache; the context was seen once before, so the question's prefill takes the
context's KV and its talker rows from the caches and computes only the question. Cache off:
both caches off, everything computed. The figure is the time to the first token (the prefill,
offline, one request at a time), the median of the rounds.

The talker stage's rows (first audio with chunked vs whole-answer hand-off, first audio at 1,
2 and 4 conversations, the real-time factor) join this table when the talker is served.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.omni_models import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, SAMPLE_RATE, OmniSizes, save_tiny_omni  # noqa: E402

WORDS = ("the a of and to in harbour light window morning river stone garden market street bridge quiet old "
         "new small bright dark green blue red yellow under over near behind across after before people walk "
         "watch carry open close build paint write read travel wait remember notice").split()


@dataclass(frozen=True)
class Scale:
    name: str
    sizes: OmniSizes
    context_words: int
    image_side: int
    clip_seconds: float
    rounds: int


FULL = Scale("omni-bench-512x8", OmniSizes(width=512, layers=8, heads=8, kv_heads=2, intermediate=2816,
                                           vision_width=192, vision_depth=8, vision_heads=3, audio_width=192,
                                           audio_layers=8, audio_heads=3, mel_bins=128, audio_window=50,
                                           max_pixels=1280 * 28 * 28),
             context_words=130, image_side=448, clip_seconds=10.0, rounds=5)
QUICK = Scale("omni-bench-quick", OmniSizes(max_pixels=64 * 28 * 28), context_words=60, image_side=112,
              clip_seconds=2.0, rounds=2)


def model_folder(scale: Scale) -> Path:
    from engine.checkpoint import converted_once

    def build(target: Path) -> None:
        # Built aside and moved in whole: a build cut short leaves no folder that looks complete.
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        save_tiny_omni("qwen2_5_omni", staging, sizes=scale.sizes)
        staging.rename(target)

    return converted_once(scale.name, build)


def words(count: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, count))


def contexts(scale: Scale) -> dict[str, tuple[str, dict]]:
    """By kind: the shared context's text and its media."""
    import PIL.Image

    rng = np.random.default_rng(0)
    side = scale.image_side
    image = PIL.Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    t = np.arange(int(SAMPLE_RATE * scale.clip_seconds)) / SAMPLE_RATE
    clip = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    # About as many tokens in each context: text alone, or text and a 256-embedding image or
    # a 250-embedding clip (the tokenizer makes about four tokens of a word).
    text = words(scale.context_words, 1)
    return {"text": (f"{text} {words(scale.context_words // 2, 2)}", {}),
            "image": (f"{text} {IMAGE_PLACEHOLDER}", {"image": [image]}),
            "audio": (f"{text} {AUDIO_PLACEHOLDER}", {"audio": [(clip, SAMPLE_RATE)]})}


def time_to_first_token(llm, text: str, media: dict) -> tuple[float, int, int]:
    """Seconds to the first token of one request alone; its prompt length and cached tokens."""
    from engine import SamplingParams

    prompt = {"prompt": text, "multi_modal_data": media} if media else text
    started = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
    return time.perf_counter() - started, len(out.prompt_token_ids), out.num_cached_tokens


def measure(folder: Path, scale: Scale) -> list[dict]:
    from engine import LLM

    rows = []
    cached_llm = LLM(str(folder), quantization="none", block_size=16, omni_speech=True)
    cold_llm = LLM(str(folder), quantization="none", block_size=16, omni_speech=True, enable_prefix_caching=False,
                   enable_encoder_cache=False)
    for kind, (context, media) in contexts(scale).items():
        # The context seen once (a first question), then the measured questions.
        time_to_first_token(cached_llm, f"{context} Question: {words(4, 100)}?", media)
        time_to_first_token(cold_llm, f"{context} Question: {words(4, 100)}?", media)  # warm-up
        on, off = [], []
        for round_index in range(scale.rounds):
            question = f"{context} Question: {words(4, 200 + round_index)}?"
            seconds, length, cached = time_to_first_token(cached_llm, question, media)
            on.append(seconds)
            off.append(time_to_first_token(cold_llm, question, media)[0])
        rows.append({"kind": kind, "prompt": length, "hit": cached / length, "off": statistics.median(off),
                     "on": statistics.median(on)})
    return rows


def print_table(rows: list[dict], scale: Scale) -> None:
    sizes = scale.sizes
    print(f"\nPrefill at a ~95% prefix hit, thinker {sizes.width} wide x {sizes.layers} layers, towers "
          f"{sizes.vision_width} x {sizes.vision_depth} (vision) and {sizes.audio_width} x {sizes.audio_layers} "
          f"(audio); median of {scale.rounds} rounds")
    print("| prompt | tokens | prefix hit | cache off TTFT (ms) | cache on TTFT (ms) | speedup |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['kind']} | {row['prompt']} | {row['hit']:.0%} | {row['off'] * 1000:.0f} | "
              f"{row['on'] * 1000:.0f} | {row['off'] / row['on']:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check that the script runs")
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    folder = model_folder(scale)
    print_table(measure(folder, scale), scale)


if __name__ == "__main__":
    main()
