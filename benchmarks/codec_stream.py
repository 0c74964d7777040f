"""Codec stream benchmark: what a streamed code2wav costs beside the whole decode, per chunk.

    python benchmarks/codec_stream.py                 # 250 codes (5 s of speech), quarter width
    python benchmarks/codec_stream.py --quick         # tiny, to check that the script runs

The codec is Qwen2.5-Omni-7B's Token2Wav in its proportions (22 DiT layers, blocks of 24 mel
frames, 2 frames a code, one look-ahead and two look-back layers; BigVGAN's kernels and
strides) at a fraction of its width, random weights. It prints the whole decode's time
(`OmniCodec.waveform`), then each chunk's time in a `CodecStream` fed all the codes at once
(the first, steady ones, the rest at finish) and the stream's total.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2_5OmniConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.adapters.qwen2_5_omni_codec_stream import CodecStream  # noqa: E402
from engine.adapters.qwen2_5_omni_talker import OmniCodec  # noqa: E402


def build_codec(width_fraction: int) -> tuple[OmniCodec, dict]:
    hidden = 1024 // width_fraction
    dit = dict(hidden_size=hidden, num_attention_heads=max(1, 16 // width_fraction), head_dim=64,
               emb_dim=512 // width_fraction, enc_emb_dim=192 // width_fraction, enc_dim=128 // width_fraction,
               enc_channels=[256 // width_fraction] * 4 + [768 // width_fraction],
               enc_attention_channels=64 // width_fraction, enc_se_channels=64 // width_fraction, dropout=0.0)
    bigvgan = dict(upsample_initial_channel=1536 // width_fraction)
    config = Qwen2_5OmniConfig(token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))
    torch.manual_seed(0)
    codec = OmniCodec(config).eval()
    speaker = {"cond": torch.randn(1, dit["enc_emb_dim"]), "ref_mel": torch.randn(1, 300, 80)}
    return codec, speaker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codes", type=int, default=250)
    parser.add_argument("--width-fraction", type=int, default=4, help="the 7B's width divided by this")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.codes, args.width_fraction = 60, 16
    codec, speaker = build_codec(args.width_fraction)
    codes = torch.randint(0, 8192, (args.codes,), generator=torch.Generator().manual_seed(1)).tolist()

    start = time.perf_counter()
    whole = codec.waveform(codes, speaker)
    whole_s = time.perf_counter() - start
    print(f"whole decode: {args.codes} codes, {len(whole) / 24000:.2f} s of audio, {whole_s:.2f} s")

    stream = CodecStream(codec, speaker, seed=0)
    print(f"stream: first chunk {stream.first_chunk_blocks} blocks (audio after {stream.codes_to_first_chunk} codes), "
          f"then {stream.chunk_blocks}; windows {stream.past_blocks} back, {stream.future_blocks} ahead")
    total = 0.0
    for index, code in enumerate(codes, start=1):
        start = time.perf_counter()
        chunks = stream.feed([code])
        spent = time.perf_counter() - start
        total += spent
        for chunk in chunks:
            print(f"  after code {index}: {len(chunk) / 24000:.2f} s of audio in {spent:.2f} s")
    start = time.perf_counter()
    rest = stream.finish()
    spent = time.perf_counter() - start
    total += spent
    print(f"  finish: {len(rest) / 24000:.2f} s of audio in {spent:.2f} s")
    print(f"stream total {total:.2f} s = {total / whole_s:.2f} x the whole decode")


if __name__ == "__main__":
    main()
