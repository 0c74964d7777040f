"""Qwen2.5-Omni's codec, streamed: codec tokens in as the talker makes them, waveform chunks out.

The codec is a DiT that integrates an ODE from noise to a mel spectrogram (`repeats` mel frames
per code), then BigVGAN from mel to waveform. The DiT's attention is blocked: a frame sees its
own block of `block_size` frames, one block ahead in each `look_ahead_layers` layer and one
block back in each `look_backward_layers` layer. So one DiT forward reads a bounded window, and
the stream decodes the answer in chunks of whole blocks, each from a window of `past_blocks`
before it to `future_blocks` after it, keeping the chunk's frames. BigVGAN then turns the kept
mel into samples through windows with enough mel on each side that the cut falls outside the
reach of the window's edges.

What is exact and what is not (`CodecStream` against `OmniCodec.waveform` on the same codes):
- The length: the concatenated chunks have the whole decode's length, always.
- The noise: frame f starts from the same noise whatever the chunking or the feeding
  (`BlockNoise`, drawn block by block from the stream's seed). It is not the noise
  `OmniCodec.waveform` draws after the same torch seed (one draw for the whole answer).
- The windows: a window starts on a block edge, so its block partition is the whole decode's;
  its positions start at 0, which changes nothing, as the DiT's rotary attention depends on
  position differences only.
- The vocoder: given the mel, the stream's samples are BigVGAN's on the whole mel to float
  rounding, because each cut lies `vocoder_edge_samples` (BigVGAN's reach, computed from its
  layers) inside its window. No crossfade is needed: the cuts add no seam of their own.
- The mel is an approximation. Each ODE step evaluates the DiT several times, and each
  evaluation widens a frame's reach by one forward's, so the whole decode's frame depends on
  blocks far beyond any bounded window (36 evaluations at 10 steps). A chunk's window covers
  one forward's reach (the defaults), as Qwen's own streaming decode does, so the mel may step
  slightly where two chunks meet (BigVGAN then smooths it like any other mel). With windows
  that span the whole answer the stream is the whole decode to float rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (Qwen2_5OmniAntiAliasedActivation1d,
                                                                    Qwen2_5OmniToken2WavBigVGANModel,
                                                                    Qwen2_5OmniToken2WavDiTModel,
                                                                    RungeKutta4ODESolver)

from engine.adapters.qwen2_5_omni_talker import OmniCodec

# The ODE settings of transformers' Token2Wav forward, which `OmniCodec.waveform` runs with.
NUM_STEPS, GUIDANCE_SCALE, SWAY_COEFFICIENT = 10, 0.5, -1.0


def dit_mel(dit: Qwen2_5OmniToken2WavDiTModel, codes: torch.Tensor, noise: torch.Tensor, speaker: dict) -> torch.Tensor:
    """The DiT's mel [1, frames, mel_dim] for `codes` [1, n] from `noise` [1, n * repeats, mel_dim]:
    transformers' `sample`, with the noise given rather than drawn."""
    cond = speaker["cond"].unsqueeze(1).repeat(1, noise.shape[1], 1)

    def velocity(time_step, state):
        guided, unguided = dit(hidden_states=state, quantized_code=codes, speaker_embedding=cond,
                               condition_vector=speaker["ref_mel"], time_step=time_step, apply_cfg=True).chunk(2)
        return guided + (guided - unguided) * GUIDANCE_SCALE

    times = torch.linspace(0, 1, NUM_STEPS, device=noise.device, dtype=noise.dtype)
    times = times + SWAY_COEFFICIENT * (torch.cos(torch.pi / 2 * times) - 1 + times)
    return RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)[-1]


def _conv_edge(conv: nn.Module, edge: int) -> int:
    """Samples at an edge of a conv's output that differ from the whole sequence's, given `edge`
    such samples at its input; the same at either edge for BigVGAN's convs (symmetric padding)."""
    if isinstance(conv, nn.ConvTranspose1d):
        return max(0, (edge - 1) * conv.stride[0] + conv.kernel_size[0] - conv.padding[0])
    return edge + conv.padding[0]


def _activation_edge(activation: Qwen2_5OmniAntiAliasedActivation1d, edge: int) -> int:
    # Up- and downsampling pad by replicating the edge sample: padding is wrong inside a window.
    up, down = activation.upsample, activation.downsample
    edge = max(0, (edge + up.pad - 1) * up.ratio + up.kernel_size - min(up.pad_left, up.pad_right))
    return math.ceil((edge + max(down.pad_left, down.pad_right)) / down.stride)


def vocoder_edge_samples(bigvgan: Qwen2_5OmniToken2WavBigVGANModel) -> int:
    """How many samples at each edge of BigVGAN's output on a window of mel frames may differ
    from its output on the whole mel; the samples further in are the whole's."""
    edge = _conv_edge(bigvgan.conv_pre, 0)
    per_stage = bigvgan.num_residual_blocks
    for stage in range(bigvgan.num_upsample_layers):
        edge = _conv_edge(bigvgan.ups[stage][0], edge)
        branches = []
        for block in bigvgan.resblocks[stage * per_stage:(stage + 1) * per_stage]:
            branch = edge
            for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, block.activations[::2],
                                                block.activations[1::2]):
                branch = _conv_edge(conv2, _activation_edge(act2, _conv_edge(conv1, _activation_edge(act1, branch))))
            branches.append(branch)
        edge = max(branches)
    return _conv_edge(bigvgan.conv_post, _activation_edge(bigvgan.activation_post, edge))


class BlockNoise:
    """The DiT's initial noise for one answer, drawn one block at a time from a generator, in
    block order: frame f gets the same noise whatever windows ask for it. Blocks before the
    oldest window still to come are forgotten."""

    def __init__(self, seed: int, block_frames: int, mel_dim: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.block_frames, self.mel_dim = block_frames, mel_dim
        self.blocks: list[torch.Tensor] = []
        self.first_block = 0  # the block self.blocks[0] is

    def frames(self, start: int, end: int) -> torch.Tensor:
        """Noise [end - start, mel_dim] for frames [start, end); start never goes back past a
        forget()."""
        while (self.first_block + len(self.blocks)) * self.block_frames < end:
            self.blocks.append(torch.randn(self.block_frames, self.mel_dim, generator=self.generator))
        drawn = torch.cat(self.blocks)
        offset = self.first_block * self.block_frames
        return drawn[start - offset:end - offset]

    def forget(self, before_frame: int) -> None:
        drop = max(0, min(before_frame // self.block_frames - self.first_block, len(self.blocks)))
        del self.blocks[:drop]
        self.first_block += drop


class CodecStream:
    """One answer's waveform, chunk by chunk, from its codec tokens as they come.

    `feed(codes)` returns the chunks that are final now; `finish()` returns the rest. Chunk
    sizes count DiT blocks (`block_size / repeats` codes each: 12 in Qwen2.5-Omni-7B), so each
    window's block partition is the whole decode's."""

    def __init__(self, codec: OmniCodec, speaker: dict, first_chunk_blocks: int | None = None,
                 chunk_blocks: int = 4, past_blocks: int | None = None, future_blocks: int | None = None,
                 seed: int | None = None) -> None:
        """`first_chunk_blocks`: None is the fewest blocks whose audio is more than BigVGAN holds
        back at a cut, so the first DiT pass already yields audio: in the 7B config BigVGAN holds
        back 35.4 frames (vocoder_edge_samples), a block is 24, so 2 blocks, and the first chunk
        comes once the talker has made 36 codes (with the block of look-ahead).
        `chunk_blocks`: each later pass; 4 (48 codes, about a second of speech) keeps the
        window's context (3 blocks) under twice the DiT work of a whole decode.
        `past_blocks` / `future_blocks`: the window around a chunk; None is one DiT forward's
        reach (one block per look-back / look-ahead layer: 2 and 1 in the 7B).
        `seed`: the noise's; None draws one from torch's global generator, so the stream is
        reproducible under torch.manual_seed as the whole decode is."""
        token2wav = codec.token2wav
        self.dit, self.bigvgan = token2wav.code2wav_dit_model, token2wav.code2wav_bigvgan_model
        self.device = next(codec.parameters()).device
        dit_config = self.dit.config
        self.repeats, self.block_frames = dit_config.repeats, dit_config.block_size
        if self.block_frames % self.repeats:
            raise ValueError(f"a DiT block of {self.block_frames} frames is not whole codes of {self.repeats}")
        self.block_codes = self.block_frames // self.repeats
        self.hop = math.prod(self.bigvgan.config.upsample_rates)
        self.vocoder_edge = vocoder_edge_samples(self.bigvgan)
        if first_chunk_blocks is None:
            first_chunk_blocks = self.vocoder_edge // (self.hop * self.block_frames) + 1
        if min(first_chunk_blocks, chunk_blocks) < 1:
            raise ValueError("a chunk is at least one DiT block")
        self.first_chunk_blocks, self.chunk_blocks = first_chunk_blocks, chunk_blocks
        self.past_blocks = len(dit_config.look_backward_layers) if past_blocks is None else past_blocks
        self.future_blocks = len(dit_config.look_ahead_layers) if future_blocks is None else future_blocks
        self.speaker = {"cond": speaker["cond"].to(self.device).float(),
                        "ref_mel": speaker["ref_mel"].to(self.device).float()}
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self.noise = BlockNoise(seed, self.block_frames, dit_config.mel_dim)
        # Codes [codes_start, num_codes) of the answer; older ones no window needs.
        self.codes: list[int] = []
        self.codes_start = self.num_codes = 0
        self.next_block = 0  # the first block whose mel is not made yet
        # Final mel [mel_dim, frames] for frames [mel_start, mel_end); older ones no cut needs.
        self.mel = torch.empty(dit_config.mel_dim, 0, device=self.device)
        self.mel_start = 0
        self.samples_out = 0  # samples returned so far
        self.finished = False

    @property
    def codes_to_first_chunk(self) -> int:
        """How many codes the stream takes before `feed` returns its first chunk (in an answer
        at least that long)."""
        blocks = self.first_chunk_blocks
        while blocks * self.block_frames * self.hop <= self.vocoder_edge:
            blocks += self.chunk_blocks
        return (blocks + self.future_blocks) * self.block_codes

    def feed(self, codes: list[int]) -> list[torch.Tensor]:
        """Take the talker's next codes; return the waveform chunks (float32, 24 kHz) now final."""
        if self.finished:
            raise RuntimeError("feed() after finish()")
        self.codes.extend(codes)
        self.num_codes += len(codes)
        chunks = []
        while self._chunk_ready():
            self._decode_chunk()
            chunk = self._vocode(final=False)
            if chunk.numel():
                chunks.append(chunk)
        return chunks

    def finish(self) -> torch.Tensor:
        """The answer is complete: the rest of its waveform (empty for an answer of no codes)."""
        if self.finished:
            raise RuntimeError("finish() twice")
        self.finished = True
        pieces = []
        while self.next_block * self.block_frames < self.num_codes * self.repeats:
            self._decode_chunk()
            pieces.append(self._vocode(final=self.next_block * self.block_frames >= self.num_codes * self.repeats))
        return torch.cat(pieces) if pieces else torch.empty(0)

    def _chunk_blocks(self) -> int:
        return self.first_chunk_blocks if self.next_block == 0 else self.chunk_blocks

    def _chunk_ready(self) -> bool:
        ahead = self.next_block + self._chunk_blocks() + self.future_blocks
        return ahead * self.block_codes <= self.num_codes

    def _decode_chunk(self) -> None:
        """The next chunk's mel, from its window; appended to the final mel."""
        start = self.next_block
        end = start + self._chunk_blocks()
        window_start = max(0, start - self.past_blocks) * self.block_codes
        window_end = min((end + self.future_blocks) * self.block_codes, self.num_codes)
        codes = torch.tensor([self.codes[window_start - self.codes_start:window_end - self.codes_start]],
                             dtype=torch.long, device=self.device)
        frame_start = window_start * self.repeats
        noise = self.noise.frames(frame_start, window_end * self.repeats).to(self.device)[None]
        with torch.inference_mode():
            mel = dit_mel(self.dit, codes, noise, self.speaker)[0]
        kept_end = min(end * self.block_frames, self.num_codes * self.repeats)
        kept = mel[start * self.block_frames - frame_start:kept_end - frame_start]
        self.mel = torch.cat([self.mel, kept.T], dim=1)
        self.next_block = end
        # The next window starts past_blocks before the next chunk.
        next_window = min(max(0, end - self.past_blocks) * self.block_codes, self.num_codes)
        del self.codes[:next_window - self.codes_start]
        self.codes_start = next_window
        self.noise.forget(next_window * self.repeats)

    def _vocode(self, final: bool) -> torch.Tensor:
        """The samples the final mel now fixes: BigVGAN over a window reaching `vocoder_edge`
        samples past the cut on the left, and as far right as the mel goes; the last
        `vocoder_edge` samples wait for more mel unless the mel is the answer's last (`final`)."""
        mel_end = self.mel_start + self.mel.shape[1]
        if not final and mel_end * self.hop - self.vocoder_edge <= self.samples_out:
            return torch.empty(0)
        # A window from frame a yields the whole's samples from a * hop on (transposed convs
        # and same-padded convs keep that alignment), so cuts are plain offsets.
        window_start = max(0, (self.samples_out - self.vocoder_edge) // self.hop)
        with torch.inference_mode():
            wav = self.bigvgan(self.mel[None, :, window_start - self.mel_start:]).reshape(-1).float().cpu()
        end = len(wav) if final else len(wav) - self.vocoder_edge
        chunk = wav[self.samples_out - window_start * self.hop:end]
        self.samples_out += len(chunk)
        keep_from = max(0, (self.samples_out - self.vocoder_edge) // self.hop)
        self.mel = self.mel[:, keep_from - self.mel_start:]
        self.mel_start = keep_from
        return chunk
