"""Qwen3-Omni's talker and code2wav: the thinker's rows -> frames of codec codes -> a waveform.

transformers' Qwen3OmniMoeForConditionalGeneration.generate is the reference. The talker (a
mixture-of-experts decoder, M-RoPE) reads, for its prompt, the user turns of the thinker's
prompt (system turns and earlier answers are dropped), then the start of the answer:

    user positions:            text_projection(embedding), or at an image's or clip's
                               positions hidden_projection(the thinker's layer
                               `accept_hidden_layer` there)
    assistant start (3 rows):  text_projection(embedding)
    5 rows:                    text pad x4, text bos, each + a codec control code
    1 row:                     the reply's first token + codec bos
    later positions:           the reply's next token (then text eos, then pad) + the
                               previous frame's codes, embedded and summed

Each step the talker says a frame's first code; a small code predictor (a dense decoder run
afresh for every frame, a position per code) says the frame's other `num_code_groups - 1`
codes from the talker's hidden state and that first code. The talker's input at the next
position is the sum of the frame's codes' embeddings. Code2wav turns frames into 24 kHz
audio, deterministically (no noise), in chunks with a left context as transformers decodes.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (Qwen3OmniMoeCode2Wav,
                                                                        Qwen3OmniMoePreTrainedModel,
                                                                        Qwen3OmniMoeTalkerForConditionalGeneration)

from engine.adapters.base import load_weights_into
from engine.sampling_params import SamplingParams

# generate suppresses the talker's top 1024 codes (control codes) but its end code.
CONTROL_CODES = 1024
# transformers' chunked decode: 300 frames a call, each with 25 frames of left context.
WHOLE_CHUNK_FRAMES, LEFT_CONTEXT_FRAMES = 300, 25
# The code predictor's sampling when the talker samples (generate's own values).
PREDICTOR_TOP_K, PREDICTOR_TOP_P = 50, 0.8


class Qwen3OmniTalker(Qwen3OmniMoePreTrainedModel):
    """The talker and its code predictor, under the checkpoint's names. forward(inputs_embeds
    at the talker's width, position_ids, logits_to_keep) -> .logits (float32) over the codec
    vocabulary, its control codes at -inf, as the runner drives any model; `kept_hidden`
    keeps the hidden states of the rows it gave logits for (the code predictor reads them)."""

    _keys_to_ignore_on_load_unexpected = [r"^thinker\.", r"^code2wav\."]

    def __init__(self, config):
        super().__init__(config)
        self.talker = Qwen3OmniMoeTalkerForConditionalGeneration._from_config(config.talker_config)
        talker = config.talker_config
        self.num_code_groups = talker.num_code_groups
        self.codec_eos = talker.codec_eos_token_id
        self.first_control_code = max(0, talker.text_config.vocab_size - CONTROL_CODES)
        self.kept_hidden: torch.Tensor | None = None
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.talker.model.codec_embedding

    def get_output_embeddings(self) -> nn.Module:
        return self.talker.codec_head

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = False,
                logits_to_keep: torch.Tensor | int = 0, **kwargs) -> CausalLMOutputWithPast:
        hidden = self.talker.model(inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=use_cache,
                                   **kwargs).last_hidden_state
        kept = hidden[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else hidden[:, logits_to_keep]
        self.kept_hidden = kept[0]
        logits = self.talker.codec_head(kept).float()
        eos = logits[..., self.codec_eos].clone()
        logits[..., self.first_control_code:] = float("-inf")
        logits[..., self.codec_eos] = eos
        return CausalLMOutputWithPast(logits=logits)

    def predict_frames(self, hidden: torch.Tensor, first_codes: torch.Tensor, choose) -> torch.Tensor:
        """Each row's frame, from the talker's hidden state [B, D] where it said its first code
        [B]: the other codes [B, num_code_groups - 1], `choose(group, logits [B, V]) -> [B]`
        picking each."""
        predictor = self.talker.code_predictor
        first = self.talker.model.codec_embedding(first_codes)
        cache = DynamicCache(config=predictor.config)
        inputs = torch.stack([hidden.to(first.dtype), first], dim=1)
        codes = []
        for group in range(self.num_code_groups - 1):
            out = predictor.model(inputs_embeds=inputs, past_key_values=cache, use_cache=True)
            codes.append(choose(group, predictor.lm_head[group](out.last_hidden_state[:, -1]).float()))
            inputs = predictor.model.codec_embedding[group](codes[-1]).unsqueeze(1)
        return torch.stack(codes, dim=1)

    def frame_rows(self, frames: torch.Tensor) -> torch.Tensor:
        """The talker's input row after each frame [N, num_code_groups]: every code's
        embedding, summed as generate sums them [N, D]."""
        embeddings = [self.talker.model.codec_embedding(frames[:, 0])]
        embeddings += [table(frames[:, group + 1])
                       for group, table in enumerate(self.talker.code_predictor.model.codec_embedding)]
        return torch.stack(embeddings, dim=1).sum(1)

    def rows_input(self, rows: torch.Tensor, from_items: torch.Tensor | None) -> torch.Tensor:
        """The thinker's rows [T, thinker width] at the talker's width: an item's rows (the
        thinker's reading of an image or clip; `from_items` flags them, None for none) through
        hidden_projection, text through text_projection."""
        rows = rows.to(self.talker.codec_head.weight.dtype)
        projected = self.talker.text_projection(rows)
        if from_items is not None:
            projected[from_items] = self.talker.hidden_projection(rows[from_items])
        return projected


# Checkpoints keep each expert's weights apart; the talker's MoE layers hold them fused.
# transformers converts them for its own classes only: this one is named to get the same.
register_checkpoint_conversion_mapping(Qwen3OmniTalker.__name__, get_checkpoint_conversion_mapping("qwen3_omni_moe"),
                                       overwrite=True)


class Qwen3OmniCodec(Qwen3OmniMoePreTrainedModel):
    """Code2wav alone: frames of codes -> a waveform, float32 as transformers runs it."""

    _keys_to_ignore_on_load_unexpected = [r"^thinker\.", r"^talker\."]

    def __init__(self, config):
        super().__init__(config)
        self.code2wav = Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config)
        self.samples_per_frame = int(self.code2wav.total_upsample)
        self.post_init()

    def decode(self, frames: list[list[int]], context: int) -> torch.Tensor:
        """The waveform [samples] of `frames` after their first `context` (read as left
        context, not said)."""
        device = next(self.parameters()).device
        codes = torch.tensor(frames, dtype=torch.long, device=device).T.unsqueeze(0)
        with torch.inference_mode():
            wav = self.code2wav(codes)
        return wav[..., context * self.samples_per_frame:].reshape(-1).float().cpu()

    def waveform(self, frames: list[list[int]], speaker=None, seed: int | None = None) -> torch.Tensor:
        """A whole answer's waveform, as generate decodes it (chunks of 300 frames, each with 25
        frames of left context); the speaker and seed change nothing (no noise)."""
        stream = self.stream(first_chunk=WHOLE_CHUNK_FRAMES, chunk=WHOLE_CHUNK_FRAMES)
        parts = [*stream.feed(frames), stream.finish()]
        return torch.cat(parts) if parts else torch.zeros(0)

    def stream(self, speaker=None, seed: int | None = None, first_chunk: int = 10, chunk: int = 25):
        return Code2WavStream(self, first_chunk, chunk)


class Code2WavStream:
    """An answer's audio as its frames come: a chunk of `first_chunk` frames first (the first
    audio sooner), then of `chunk` frames, each decoded with up to 25 frames of left context,
    the last one by `finish`. The chunks are what transformers' chunked decode makes with the
    same boundaries (the talker's own decode uses 300-frame chunks: `waveform`)."""

    def __init__(self, codec: Qwen3OmniCodec, first_chunk: int, chunk: int) -> None:
        self.codec = codec
        self.first_chunk, self.chunk = first_chunk, chunk
        # The frames not decoded yet, after (up to) the left context's worth of decoded ones.
        self.frames: list[list[int]] = []
        self.context = 0  # how many of `frames` are decoded (left context only)
        self.decoded = 0  # frames whose audio has been made, in all

    def feed(self, frames: list[list[int]]) -> list[torch.Tensor]:
        self.frames.extend(frames)
        chunks = []
        while len(self.frames) - self.context >= (self.chunk if self.decoded else self.first_chunk):
            chunks.append(self._decode(self.chunk if self.decoded else self.first_chunk))
        return chunks

    def finish(self) -> torch.Tensor:
        pending = len(self.frames) - self.context
        return self._decode(pending) if pending else torch.zeros(0)

    def _decode(self, count: int) -> torch.Tensor:
        wav = self.codec.decode(self.frames[:self.context + count], self.context)
        self.decoded += count
        # Only the left context of the next chunk is kept.
        kept = min(LEFT_CONTEXT_FRAMES, self.context + count)
        self.frames = self.frames[self.context + count - kept:]
        self.context = kept
        return wav


class Qwen3ThinkerEmbeddings(Qwen3OmniMoePreTrainedModel):
    """The thinker's token embeddings alone, for a talker process that has no thinker: its
    text rows (pad, bos, eos) are the embeddings of three special tokens."""

    _keys_to_ignore_on_load_unexpected = [r"^thinker\.(?!model\.embed_tokens\.)", r"^talker\.", r"^code2wav\."]

    def __init__(self, config):
        super().__init__(config)
        text = config.thinker_config.text_config
        self.thinker = nn.Module()
        self.thinker.model = nn.Module()
        self.thinker.model.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.thinker.model.embed_tokens


class Qwen3TalkerSpec:
    """What the talker stage needs to know of a Qwen3-Omni checkpoint (see TalkerSpec, the
    Qwen2.5-Omni one, for the interface): special codes, speakers, the text rows of its
    special tokens, how to load the talker and code2wav."""

    sample_rate = 24000
    # generate's talker sampling: top-k 50, temperature 0.9, repetition penalty 1.05.
    default_sampling = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, max_tokens=4096)

    def __init__(self, model_path: Path, hf_config, thinker_embeddings: nn.Module) -> None:
        self.model_path = Path(model_path)
        talker = hf_config.talker_config
        self.num_code_groups = talker.num_code_groups
        self.codec_eos, self.codec_pad, self.codec_bos = (talker.codec_eos_token_id, talker.codec_pad_id,
                                                          talker.codec_bos_id)
        self.start_codes = [talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id]
        self.speakers = dict(talker.speaker_id)
        width = hf_config.thinker_config.text_config.hidden_size
        with torch.inference_mode():
            weight_device = thinker_embeddings.weight.device
            ids = torch.tensor([hf_config.tts_pad_token_id, hf_config.tts_bos_token_id, hf_config.tts_eos_token_id],
                               device=weight_device)
            # (An offline thinker's input rows may be wider: deepstack levels follow the embedding.)
            self.text_pad, self.text_bos, self.text_eos = thinker_embeddings(ids)[..., :width].float().cpu()

    @classmethod
    def from_checkpoint(cls, model_path: Path, thinker_embeddings: nn.Module | None = None) -> "Qwen3TalkerSpec":
        from transformers import AutoConfig

        if thinker_embeddings is None:
            thinker_embeddings = load_weights_into(Qwen3ThinkerEmbeddings, Path(model_path), torch.float32,
                                                   "cpu").get_input_embeddings()
        return cls(model_path, AutoConfig.from_pretrained(model_path), thinker_embeddings)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.codec_eos,)

    def talker_params(self, params: SamplingParams) -> SamplingParams:
        """`params` for the talker: it stops at its end code (its other control codes are never
        said: the model's logits rule them out), whatever `ignore_eos` said."""
        return msgspec.structs.replace(params, stop_token_ids=list(self.stop_token_ids), ignore_eos=False)

    def prompt_token_ids(self, num_kept: int, speaker: str) -> list[int]:
        # The kept rows carry no codec code (pad here, a control code the talker never says,
        # so no penalty can touch a code it may say).
        return [self.codec_pad] * num_kept + [*self.start_codes, self.speakers[speaker], self.codec_pad,
                                              self.codec_bos]

    def start_rows(self, speaker: str) -> torch.Tensor:
        """The text rows between the kept prompt rows and the reply's: pad x4, then bos."""
        return torch.stack([self.text_pad] * 4 + [self.text_bos])

    def load_talker(self, dtype: torch.dtype, device, attn_implementation: str) -> Qwen3OmniTalker:
        model = load_weights_into(Qwen3OmniTalker, self.model_path, dtype, device)
        model.talker.model.config._attn_implementation = attn_implementation
        # The code predictor runs a few positions afresh per frame: dense attention.
        model.talker.code_predictor.model.config._attn_implementation = "sdpa"
        return model

    def load_codec(self, device) -> Qwen3OmniCodec:
        return load_weights_into(Qwen3OmniCodec, self.model_path, torch.float32, device)
