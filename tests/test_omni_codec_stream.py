"""The codec, streamed: chunks of waveform from codec tokens as the talker makes them.

The tiny checkpoint's DiT barely mixes frames (its initialisation keeps attention and the ODE's
velocity small, so a frame's mel is nearly its noise), which would let a wrong window pass
unseen. The tests re-draw its layers at a gain where a window's context moves the mel by
percents: then the chunked reference below pins the windows, offsets and cuts to float
rounding, and the stream's distance from the whole decode is a measured, stated figure.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn
from transformers import Qwen2_5OmniBigVGANConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

from engine.adapters.base import load_weights_into
from engine.adapters.qwen2_5_omni_codec_stream import BlockNoise, CodecStream, vocoder_edge_samples
from engine.adapters.qwen2_5_omni_talker import OmniCodec
from tests.omni_models import CODEC_PAD, save_tiny_omni

SEED, NUM_CODES = 7, 40
# Tiny DiT: blocks of 8 frames, 2 frames a code, so 4 codes a block; 40 codes are 10 blocks.
# Chunks of 3 (the default first chunk here), then 2 blocks: 5 chunks, 4 of them before finish.
FIRST, STEADY, PAST, FUTURE = 3, 2, 2, 1


@pytest.fixture(scope="module")
def codec_and_speaker(tmp_path_factory):
    folder = save_tiny_omni("qwen2_5_omni", tmp_path_factory.mktemp("codec-stream") / "qwen2_5_omni")
    codec = load_weights_into(OmniCodec, folder, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in codec.token2wav.code2wav_dit_model.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0, 2 / module.in_features ** 0.5, generator=generator)
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0, 1, generator=generator)
    return codec, torch.load(folder / "spk_dict.pt", weights_only=True)["Chelsie"]


def some_codes(count: int) -> list[int]:
    return torch.randint(0, CODEC_PAD, (count,), generator=torch.Generator().manual_seed(count)).tolist()


def stream(codec, speaker, codes, **options) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every chunk `feed` returned, and what `finish` returned."""
    codec_stream = CodecStream(codec, speaker, **options)
    return codec_stream.feed(codes), codec_stream.finish()


def stream_noise(codec, count: int) -> torch.Tensor:
    """The noise a stream with SEED starts `count` codes from, [1, frames, mel_dim]."""
    config = codec.token2wav.code2wav_dit_model.config
    return BlockNoise(SEED, config.block_size, config.mel_dim).frames(0, count * config.repeats)[None]


def whole_decode(codec, speaker, codes, noise) -> torch.Tensor:
    """OmniCodec.waveform, its noise being `noise` rather than a fresh draw."""
    with mock.patch("torch.randn", lambda *args, **kwargs: noise.clone()):
        return codec.waveform(codes, speaker)


@pytest.fixture(scope="module")
def answer(codec_and_speaker):
    """NUM_CODES codes: the stream's chunks and rest, and the whole decode from the same noise."""
    codec, speaker = codec_and_speaker
    codes = some_codes(NUM_CODES)
    chunks, rest = stream(codec, speaker, codes, first_chunk_blocks=FIRST, chunk_blocks=STEADY, past_blocks=PAST,
                          future_blocks=FUTURE, seed=SEED)
    return codes, chunks, rest, whole_decode(codec, speaker, codes, stream_noise(codec, NUM_CODES))


def chunked_reference(codec, speaker, codes, noise) -> torch.Tensor:
    """The same windows, built here with transformers' own DiT sampler and one BigVGAN pass over
    the kept mel: chunks of FIRST then STEADY blocks, each from PAST blocks before to FUTURE after."""
    dit, bigvgan = codec.token2wav.code2wav_dit_model, codec.token2wav.code2wav_bigvgan_model
    block_frames, repeats = dit.config.block_size, dit.config.repeats
    frames = len(codes) * repeats
    edges = [0, FIRST]
    while edges[-1] * block_frames < frames:
        edges.append(edges[-1] + STEADY)
    kept = []
    for start, end in zip(edges, edges[1:]):
        low, high = max(0, start - PAST) * block_frames, min((end + FUTURE) * block_frames, frames)
        window_codes = torch.tensor([codes[low // repeats:high // repeats]])
        with mock.patch("torch.randn", lambda *args, **kwargs: noise[:, low:high].clone()), torch.inference_mode():
            mel = dit.sample(speaker["cond"].float(), speaker["ref_mel"].float(), window_codes)  # [1, mel, frames]
        kept.append(mel[..., start * block_frames - low:min(end * block_frames, frames) - low])
    with torch.inference_mode():
        return bigvgan(torch.cat(kept, dim=-1)).reshape(-1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("count", [1, 5, 12, 40])
def test_chunks_add_up_to_the_whole_decode_s_length(codec_and_speaker, count):
    # 1 code; fewer than the first chunk (3 blocks, 12 codes); exactly the first chunk; 5 chunks.
    codec, speaker = codec_and_speaker
    codes = some_codes(count)
    chunks, rest = stream(codec, speaker, codes, chunk_blocks=STEADY)
    assert sum(len(chunk) for chunk in chunks) + len(rest) == len(codec.waveform(codes, speaker))
    assert all(chunk.dtype == torch.float32 and chunk.ndim == 1 for chunk in chunks + [rest])


def test_stream_equals_its_windows_built_with_transformers(codec_and_speaker, answer):
    codec, speaker = codec_and_speaker
    codes, chunks, rest, _ = answer
    assert len(chunks) == 4  # the last chunk waits for finish(): its window would reach past the answer
    reference = chunked_reference(codec, speaker, codes, stream_noise(codec, NUM_CODES))
    got = torch.cat(chunks + [rest])
    np.testing.assert_allclose(got.numpy(), reference.numpy(), rtol=0, atol=1e-5 * reference.abs().max().item())


def test_default_windows_come_within_a_few_percent_of_the_whole_decode(codec_and_speaker, answer):
    # One DiT forward's reach is not the ODE's (36 forwards), so the mel of a chunk differs from
    # the whole decode's; with these weights the waveform's relative error is about 4%, and it
    # shrinks as the windows widen, to float rounding once they span the answer.
    codec, speaker = codec_and_speaker
    codes, chunks, rest, whole = answer
    default_error = relative_error(torch.cat(chunks + [rest]), whole)
    assert 1e-3 < default_error < 0.1
    wider_chunks, wider_rest = stream(codec, speaker, codes, first_chunk_blocks=FIRST, chunk_blocks=STEADY,
                                      past_blocks=PAST + 2, future_blocks=FUTURE + 2, seed=SEED)
    assert relative_error(torch.cat(wider_chunks + [wider_rest]), whole) < default_error / 2
    spanning_chunks, spanning_rest = stream(codec, speaker, codes, first_chunk_blocks=FIRST, chunk_blocks=STEADY,
                                            past_blocks=100, future_blocks=100, seed=SEED)
    np.testing.assert_allclose(torch.cat(spanning_chunks + [spanning_rest]).numpy(), whole.numpy(), rtol=0,
                               atol=1e-5 * whole.abs().max().item())


def test_first_chunk_comes_early_and_code_by_code_feeding_changes_nothing(codec_and_speaker, answer):
    codec, speaker = codec_and_speaker
    codes, chunks, rest, _ = answer
    codec_stream = CodecStream(codec, speaker, first_chunk_blocks=FIRST, chunk_blocks=STEADY, past_blocks=PAST,
                               future_blocks=FUTURE, seed=SEED)
    fed = [codec_stream.feed([code]) for code in codes]
    first = next(count for count, out in enumerate(fed, start=1) if out)
    # The first chunk's 3 blocks (4 codes each) and the block of look-ahead it needs: 16 codes.
    assert first == codec_stream.codes_to_first_chunk == (FIRST + FUTURE) * 4
    # 3 blocks is the default here: BigVGAN holds back 23.1 frames at a cut, a block is 8.
    assert CodecStream(codec, speaker).first_chunk_blocks == FIRST
    one_by_one = torch.cat([chunk for out in fed for chunk in out] + [codec_stream.finish()])
    assert torch.equal(one_by_one, torch.cat(chunks + [rest]))


def test_finish_without_codes_is_empty(codec_and_speaker):
    codec, speaker = codec_and_speaker
    chunks, rest = stream(codec, speaker, [])
    assert chunks == [] and rest.shape == (0,) and rest.dtype == torch.float32


def test_stream_is_reproducible_under_a_torch_seed(codec_and_speaker):
    codec, speaker = codec_and_speaker
    codes = some_codes(20)  # one chunk from feed, the rest from finish

    def after_torch_seed(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        codec_stream = CodecStream(codec, speaker)
        torch.randn(3)  # the stream took its seed when made: later draws elsewhere change nothing
        return torch.cat([*codec_stream.feed(codes), codec_stream.finish()])

    first = after_torch_seed(0)
    assert torch.equal(first, after_torch_seed(0))
    assert not torch.allclose(first, after_torch_seed(1))


def bigvgan_7b_shaped() -> Qwen2_5OmniToken2WavBigVGANModel:
    # The 7B's kernels, strides and dilations (transformers' defaults), with few channels: the
    # reach depends on the former only.
    torch.manual_seed(0)
    return Qwen2_5OmniToken2WavBigVGANModel(Qwen2_5OmniBigVGANConfig(upsample_initial_channel=64)).eval()


@pytest.mark.parametrize("shape", ["tiny", "7b"])
def test_vocoder_windows_match_the_whole_mel_past_the_edge(codec_and_speaker, shape):
    bigvgan = codec_and_speaker[0].token2wav.code2wav_bigvgan_model if shape == "tiny" else bigvgan_7b_shaped()
    hop = int(np.prod(bigvgan.config.upsample_rates))
    edge = vocoder_edge_samples(bigvgan)
    # A window of 120 frames: more than the 7B's two edges (2 x 35.4 frames).
    mel = torch.randn(1, bigvgan.config.mel_dim, 200, generator=torch.Generator().manual_seed(1))
    start, end = 40, 160
    with torch.inference_mode():
        whole, window = bigvgan(mel).reshape(-1), bigvgan(mel[..., start:end]).reshape(-1)
    aligned = whole[start * hop:start * hop + len(window)]
    tolerance = 1e-5 * whole.abs().max().item()
    np.testing.assert_allclose(window[edge:-edge].numpy(), aligned[edge:-edge].numpy(), rtol=0, atol=tolerance)
    # The edge is real: right at it the window's samples are not the whole's.
    assert (window[:1] - aligned[:1]).abs().item() > tolerance
    assert (window[-1:] - aligned[-1:]).abs().item() > tolerance
