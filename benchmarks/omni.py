"""Omni benchmark: what the thinker's prefix cache (KV and hidden-state rows, seed 002) buys at a
~95% prefix hit, for a text, an image and an audio prompt. One run prints one table; every
ratio is against the cache-off run of the same prompt in the same run.

    python benchmarks/omni.py            # the full run (about 4 minutes on 2 quiet cores)
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

A second table: the time from a spoken answer's request to its first codec token, at 1, 2
and 4 conversations started together (offline: thinker and talker in one process, taking
turns), with the chunked hand-off (the talker starts on the thinker's first reply token) and
with the whole answer handed over; the talker's proportions to the thinker are the 7B's (a
quarter of its width, its depth). The codec turns a whole answer's codes into audio at its
end, so first audio itself is not measured yet (chunked code2wav is still to come), nor the
real-time factor.
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
    # Spoken answers: text tokens and codec tokens each.
    text_tokens: int = 48
    codes: int = 96


FULL = Scale("omni-bench-512x8-t128", OmniSizes(width=512, layers=8, heads=8, kv_heads=2, intermediate=2816,
                                                vision_width=192, vision_depth=8, vision_heads=3, audio_width=192,
                                                audio_layers=8, audio_heads=3, mel_bins=128, audio_window=50,
                                                max_pixels=1280 * 28 * 28, talker_width=128, talker_layers=8,
                                                talker_heads=2),
             context_words=130, image_side=448, clip_seconds=10.0, rounds=5)
QUICK = Scale("omni-bench-quick", OmniSizes(max_pixels=64 * 28 * 28), context_words=60, image_side=112,
              clip_seconds=2.0, rounds=2, text_tokens=8, codes=16)


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


def first_codes(llm, speech, prompts: list[str], text_tokens: int, codes: int) -> list[float]:
    """Speaks `prompts` together; each answer's seconds to its first codec token."""
    from engine import SamplingParams

    # Fixed lengths: the random talker may not say its end codes.
    talker = SamplingParams(temperature=0, max_tokens=codes, logit_bias={speech.spec.codec_pad: -100.0,
                                                                        speech.spec.codec_eos: -100.0})
    talker = speech.talker_params(talker)
    text = SamplingParams(temperature=0, max_tokens=text_tokens, ignore_eos=True)
    started = time.perf_counter()
    first: dict[str, float] = {}
    pending = set()
    for prompt in prompts:
        request = llm.engine.make_request(prompt, text)
        llm.engine.add_engine_request(request)
        speech.add(request.request_id, request.prompt_token_ids, [], "Chelsie", talker)
        pending.add(request.request_id)
    while pending:
        speech.after_thinker_step(llm.engine.step())
        for answer in list(speech.answers.values()):
            if answer.codes and answer.request_id not in first:
                first[answer.request_id] = time.perf_counter() - started
        for answer in speech.talker_step():
            first.setdefault(answer.request_id, time.perf_counter() - started)
            pending.discard(answer.request_id)
    while llm.engine.has_unfinished_requests:
        llm.engine.step()
    return sorted(first.values())


def measure_speech(folder: Path, scale: Scale) -> list[dict]:
    from engine import LLM
    from engine.omni_speech import OmniSpeech

    llm = LLM(str(folder), quantization="none", block_size=16, omni_speech=True)
    speeches = {handoff: OmniSpeech(llm.engine, handoff=handoff) for handoff in ("chunked", "whole")}
    rows = []
    for conversations in (1, 2, 4):
        for handoff, speech in speeches.items():
            firsts = []
            for round_index in range(scale.rounds):
                prompts = [f"Question {round_index}-{k}: {words(40, 300 + 10 * round_index + k)}?"
                           for k in range(conversations)]
                firsts.append(statistics.median(first_codes(llm, speech, prompts, scale.text_tokens, scale.codes)))
            rows.append({"conversations": conversations, "handoff": handoff, "first": statistics.median(firsts)})
    return rows


def print_speech_table(rows: list[dict], scale: Scale) -> None:
    sizes = scale.sizes
    print(f"\nTime to the first codec token, talker {sizes.talker_width} wide x {sizes.talker_layers} layers, "
          f"{scale.text_tokens} text tokens and {scale.codes} codes an answer, median of {scale.rounds} rounds")
    print("| conversations | chunked hand-off (ms) | whole-answer hand-off (ms) | whole / chunked |")
    print("|---|---|---|---|")
    by_key = {(row["conversations"], row["handoff"]): row["first"] for row in rows}
    for conversations in (1, 2, 4):
        chunked, whole = by_key[(conversations, "chunked")], by_key[(conversations, "whole")]
        print(f"| {conversations} | {chunked * 1000:.0f} | {whole * 1000:.0f} | {whole / chunked:.1f}x |")


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
    print_speech_table(measure_speech(folder, scale), scale)


if __name__ == "__main__":
    main()
