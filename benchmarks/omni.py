"""Omni benchmark: what the thinker's prefix cache (KV and hidden-state rows, seed 002) buys at a
~95% prefix hit, for a text, an image and an audio prompt; then what spoken answers cost. Every
prefill ratio is against the cache-off run of the same prompt in the same run.

    python benchmarks/omni.py            # the full run (about 8 minutes on 2 quiet cores)
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

A second table: spoken answers at 1, 2 and 4 conversations started together, with the chunked
hand-off (the talker starts on the thinker's first reply token) and with the whole answer
handed over. Each answer's codes go through a CodecStream as the talker makes them, as the
talker process does (workers/omni_talker_worker.py); thinker, talker and codec take turns in
one process (offline; in the server the thinker runs in a process of its own). Per answer:
the time from the request to its first audio chunk (the first non-empty chunk the stream
returns), the median over a round's answers and then over the rounds. Per round: the
real-time factor, the wall seconds spent in talker steps and codec calls (`stage.step()`,
`CodecStream.feed` / `finish`; not the thinker's steps, nor handing it rows) over the seconds
of audio those calls made, all answers of all rounds together (under 1: faster than
real time).

Every stage is scaled alike, so the stages keep the 7B's weight against each other: each at
about a seventh or an eighth of its width and 8 layers. The thinker 512 wide (3584 in the
7B), the talker 128 (896), and the codec the 7B's code2wav (DiT blocks of 24 mel frames, 2 a
code, look-back and look-ahead layers where the 7B has them; BigVGAN's kernels and strides,
24 kHz) with a DiT 128 wide (1024) and every other channel count scaled alike. At a quarter
of the 7B's width the codec alone takes seconds a chunk on a CPU (benchmarks/codec_stream.py).
A CPU is not the target: the speech table's figures are for their ratios (chunked against
whole, 2 and 4 conversations against 1). Run it on quiet cores: on cores busy with other
work torch's threads wait on each other and the codec slows many times over, unevenly
(OMP_NUM_THREADS=1 keeps such a run steady, and slower).
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
    # Spoken answers: text tokens and codec tokens each; rounds at each count of conversations.
    text_tokens: int = 48
    codes: int = 96
    speech_rounds: int = 3


FULL = Scale("omni-bench-512x8-t128-c128x8",
             OmniSizes(width=512, layers=8, heads=8, kv_heads=2, intermediate=2816, vision_width=192, vision_depth=8,
                       vision_heads=3, audio_width=192, audio_layers=8, audio_heads=3, mel_bins=128, audio_window=50,
                       max_pixels=1280 * 28 * 28, talker_width=128, talker_layers=8, talker_heads=2,
                       codec_width=128, codec_layers=8),
             context_words=130, image_side=448, clip_seconds=10.0, rounds=5,
             # A short spoken answer's text: the whole-answer hand-off waits for all of it.
             text_tokens=128)
# The smallest 7B-proportioned codec; enough codes that the first chunk comes before the end.
QUICK = Scale("omni-bench-quick-c64x3", OmniSizes(max_pixels=64 * 28 * 28, codec_width=64, codec_layers=3),
              context_words=60, image_side=112, clip_seconds=2.0, rounds=2, text_tokens=8, codes=40, speech_rounds=1)


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


@dataclass
class SpokenRound:
    """One round of spoken answers: each answer's seconds to its first audio chunk; the seconds
    spent in talker steps and codec calls, and the seconds of audio they made."""

    first_audio: list[float]
    work: float
    audio: float


def speak(llm, speech, prompts: list[str], text_tokens: int, codes: int) -> SpokenRound:
    """Speaks `prompts` together, each answer's new codes fed to its own CodecStream after every
    talker step, as the talker process does."""
    from engine import SamplingParams
    from engine.adapters.qwen2_5_omni_codec_stream import CodecStream

    # Fixed lengths: the random talker may not say its end codes.
    talker = SamplingParams(temperature=0, max_tokens=codes, seed=0,
                            logit_bias={speech.spec.codec_pad: -100.0, speech.spec.codec_eos: -100.0})
    talker = speech.talker_params(talker)
    text = SamplingParams(temperature=0, max_tokens=text_tokens, ignore_eos=True)
    started = time.perf_counter()
    codecs: dict[str, CodecStream] = {}
    first: dict[str, float] = {}
    work = samples = 0

    def heard(request_id: str, chunks: list) -> None:
        nonlocal samples
        made = sum(len(chunk) for chunk in chunks)
        samples += made
        if made and request_id not in first:
            first[request_id] = time.perf_counter() - started

    for prompt in prompts:
        request = llm.engine.make_request(prompt, text)
        llm.engine.add_engine_request(request)
        speech.add(request.request_id, request.prompt_token_ids,
                   speech.talker_prompt(request.prompt_token_ids, request.mm_placeholders), "Chelsie", talker)
    pending = len(prompts)
    while pending:
        speech.after_thinker_step(llm.engine.step())
        step_started = time.perf_counter()
        for update in speech.stage.step():
            answer = update.answer
            if answer.error is not None:
                raise RuntimeError(f"the talker failed: {answer.error}")
            if answer.request_id not in codecs:
                codecs[answer.request_id] = speech.stage.codec_stream(answer)
            stream = codecs[answer.request_id]
            heard(answer.request_id, stream.feed(update.new_codes))
            if update.finished:
                heard(answer.request_id, [stream.finish()])
                pending -= 1
        work += time.perf_counter() - step_started
    while llm.engine.has_unfinished_requests:
        llm.engine.step()
    return SpokenRound(list(first.values()), work, samples / speech.spec.sample_rate)


def measure_speech(folder: Path, scale: Scale) -> list[dict]:
    from engine import LLM
    from engine.omni_speech import OmniSpeech

    llm = LLM(str(folder), quantization="none", block_size=16, omni_speech=True)
    speeches = {handoff: OmniSpeech(llm.engine, handoff=handoff) for handoff in ("chunked", "whole")}
    # One answer unmeasured: the first codec and talker calls pay one-time costs.
    speak(llm, speeches["chunked"], ["Warm-up?"], scale.text_tokens, scale.codes)
    rows = []
    for conversations in (1, 2, 4):
        for handoff, speech in speeches.items():
            rounds = []
            for round_index in range(scale.speech_rounds):
                prompts = [f"Question {round_index}-{k}: {words(40, 300 + 10 * round_index + k)}?"
                           for k in range(conversations)]
                rounds.append(speak(llm, speech, prompts, scale.text_tokens, scale.codes))
            rows.append({"conversations": conversations, "handoff": handoff,
                         "first": statistics.median(statistics.median(r.first_audio) for r in rounds),
                         "rtf": sum(r.work for r in rounds) / sum(r.audio for r in rounds),
                         "answer_audio": sum(r.audio for r in rounds) / (conversations * len(rounds))})
    return rows


def print_speech_table(rows: list[dict], scale: Scale) -> None:
    sizes = scale.sizes
    by_key = {(row["conversations"], row["handoff"]): row for row in rows}
    print(f"\nSpoken answers: time to the first audio chunk, and the real-time factor (seconds in talker steps "
          f"and codec calls / seconds of audio made); talker {sizes.talker_width} wide x {sizes.talker_layers} "
          f"layers, codec DiT {sizes.codec_width} wide x {sizes.codec_layers} layers (Qwen2.5-Omni-7B's code2wav, "
          f"1024 x 22 there, scaled); {scale.text_tokens} text tokens and {scale.codes} codes "
          f"({by_key[(1, 'chunked')]['answer_audio']:.2f} s of audio) an answer; median of {scale.speech_rounds} "
          f"rounds. This CPU is not the target: read the ratios.")
    print("| conversations | first audio, chunked (ms) | first audio, whole (ms) | whole / chunked | "
          "chunked, N / 1 conversation | real-time factor, chunked | real-time factor, whole |")
    print("|---|---|---|---|---|---|---|")
    alone = by_key[(1, "chunked")]["first"]
    for conversations in (1, 2, 4):
        chunked, whole = by_key[(conversations, "chunked")], by_key[(conversations, "whole")]
        print(f"| {conversations} | {chunked['first'] * 1000:.0f} | {whole['first'] * 1000:.0f} | "
              f"{whole['first'] / chunked['first']:.1f}x | {chunked['first'] / alone:.1f}x | "
              f"{chunked['rtf']:.2f} | {whole['rtf']:.2f} |")


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
