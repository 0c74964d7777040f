"""Qwen3-Omni's thinker (Qwen3OmniMoeForConditionalGeneration, model_type qwen3_omni_moe).

The seam is Qwen2.5-Omni's (Qwen2_5OmniAdapter): images and audio clips are encoder items,
positions are M-RoPE with audio placed as text. What differs, and lives here:

- Audio: the tower cuts a clip's mel frames into chunks of 2 * n_window (100 frames, 1 s),
  runs three stride-2 convolutions per chunk (13 embeddings of a whole chunk, about 80 ms
  each) and attends within windows of n_window_infer frames. The processor does not pad a
  clip to 30 s (Qwen2.5's does): the clip's own frames, no more.
- Language model: a mixture-of-experts decoder (q/k norms, interleaved M-RoPE) driven with
  inputs_embeds and the engine's paged attention, as any language model.
- Images: the vision tower also yields "deepstack" features, one per chosen vision layer,
  which the language model adds to the image's positions after each of its first layers. An
  image item's rows are therefore wide, [embedding | level 1 | ... | level k] (k * hidden
  more), and every other row is as wide with zeros there (text tokens, audio): the encoder
  cache and the runner move rows of any width, and the thinker splits them again. The cost:
  a step's input rows are 1 + k times the hidden size wide (4x for the 30B-A3B, k = 3), and
  the encoder cache holds as many bytes per embedding (embedding_size() says so).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder, Qwen3OmniMoePreTrainedModel, Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3OmniMoeVisionEncoder)

from engine.adapters.base import load_weights_into
from engine.adapters.qwen2_5_omni import Qwen2_5OmniAdapter
from engine.media import MediaError
from engine.mm_inputs import ProcessedItem
from engine.thinker_rows import TalkerPrompt


# The talker's prompt ends with six codec codes (no-think, think bos / eos, the speaker, pad,
# bos) over its five start rows and the reply's first row.
TALKER_START_CODES = 6


def _convolved(num_frames: int) -> int:
    """Length after the tower's three stride-2 convolutions (kernel 3, padding 1)."""
    for _ in range(3):
        num_frames = (num_frames + 1) // 2
    return num_frames


# transformers' _get_feat_extract_output_lengths counts 13 embeddings per whole chunk whatever
# n_window is, and the tower selects its output rows by that count: only chunks that convolve
# to 13 give embeddings that are the tower's own.
EMBEDDINGS_PER_WHOLE_CHUNK = 13


class Qwen3OmniEncoder(Qwen3OmniMoePreTrainedModel):
    """The thinker's vision and audio towers under the checkpoint's names (thinker.visual,
    thinker.audio_tower), so from_pretrained loads them and skips the language models."""

    _keys_to_ignore_on_load_unexpected = [r"^(?!thinker\.(model\.)?(visual|audio_tower)\.)"]

    def __init__(self, config):
        super().__init__(config)
        thinker = config.thinker_config
        self.thinker = nn.Module()
        self.thinker.visual = Qwen3OmniMoeVisionEncoder._from_config(thinker.vision_config)
        self.thinker.audio_tower = Qwen3OmniMoeAudioEncoder._from_config(thinker.audio_config)
        self.post_init()

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Every image's rows, concatenated: [merged embedding | deepstack levels in the order
        the language model adds them], as get_image_features returns them side by side."""
        visual = self.thinker.visual
        out = visual(pixel_values.type(visual.dtype), grid_thw=grid_thw)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def encode_audio(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """As get_audio_features: clips' features [mel, sum(frames)] side by side in time;
        every clip's embeddings, concatenated."""
        tower = self.thinker.audio_tower
        return tower(features.type(tower.conv2d1.weight.dtype), feature_lens=frames).last_hidden_state


class ThinkerInputRows(nn.Module):
    """The thinker's input rows of token ids: the token embedding, zeros where deepstack levels go."""

    def __init__(self, embed_tokens: nn.Embedding, extra_width: int):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.extra_width = extra_width

    @property
    def weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed_tokens(input_ids)
        return torch.cat([rows, rows.new_zeros(*rows.shape[:-1], self.extra_width)], dim=-1)


class Qwen3OmniThinker(Qwen3OmniMoePreTrainedModel):
    """The thinker's language model and output layer, driven as the runner drives any model:
    forward(inputs_embeds, position_ids, logits_to_keep) -> .logits, with wide input rows
    (see the module docstring). Its towers are never built (the encoder process runs them),
    nor the talker or code2wav.

    `talker_hidden_states` keeps the step's hidden states at the layer the talker reads
    (talker_config.accept_hidden_layer, counted as transformers counts hidden_states: 0 is
    the input, k the output of layer k - 1, before any deepstack level is added to it)."""

    # The towers (under both key layouts) and the other stages are skipped on purpose.
    _keys_to_ignore_on_load_unexpected = [r"^talker\.", r"^code2wav\.", r"^thinker\.(model\.)?(visual|audio_tower)\."]

    def __init__(self, config):
        super().__init__(config)
        # Built whole, then its towers dropped: the class owns the checkpoint's key renames.
        self.thinker = Qwen3OmniMoeThinkerForConditionalGeneration._from_config(config.thinker_config)
        del self.thinker.model.visual, self.thinker.model.audio_tower
        self.width = config.thinker_config.text_config.hidden_size
        self.levels = len(config.thinker_config.vision_config.deepstack_visual_indexes)
        self.talker_layer = config.talker_config.accept_hidden_layer
        self.talker_hidden_states: torch.Tensor | None = None
        self.post_init()
        layers = self.thinker.model.language_model.layers
        if 0 < self.talker_layer < len(layers):
            layers[self.talker_layer - 1].register_forward_hook(self._keep_talker_hidden_states)

    def _keep_talker_hidden_states(self, module, args, output) -> None:
        self.talker_hidden_states = output[0] if isinstance(output, tuple) else output

    def get_input_embeddings(self) -> nn.Module:
        # A wrapper made per call, never a child module: the embedding's weight keeps one name.
        return ThinkerInputRows(self.thinker.model.language_model.embed_tokens, self.levels * self.width)

    def get_output_embeddings(self) -> nn.Module:
        return self.thinker.lm_head

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = False,
                logits_to_keep: torch.Tensor | int = 0, **kwargs) -> CausalLMOutputWithPast:
        rows = inputs_embeds[..., :self.width]
        # Level l is added after layer l at every position: zeros but where an image is, so this
        # is transformers' addition at the image's positions (x + 0 is x).
        levels = inputs_embeds[0, :, self.width:].unflatten(-1, (self.levels, self.width)).unbind(-2)
        every_row = torch.ones(inputs_embeds.shape[:2], dtype=torch.bool, device=inputs_embeds.device)
        hidden = self.thinker.model.language_model(
            inputs_embeds=rows, position_ids=position_ids, use_cache=use_cache, visual_pos_masks=every_row,
            deepstack_visual_embeds=list(levels), **kwargs).last_hidden_state
        if self.talker_layer == 0:
            self.talker_hidden_states = rows
        elif self.talker_layer >= len(self.thinker.model.language_model.layers):
            self.talker_hidden_states = hidden
        kept = hidden[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else hidden[:, logits_to_keep]
        return CausalLMOutputWithPast(logits=self.thinker.lm_head(kept))


class Qwen3OmniAdapter(Qwen2_5OmniAdapter):
    audio_placeholder_text = "<|audio_start|><|audio_pad|><|audio_end|>"
    image_placeholder_text = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, model_path: Path, hf_config):
        super().__init__(model_path, hf_config)
        audio = hf_config.thinker_config.audio_config
        self.chunk_frames = 2 * audio.n_window
        if _convolved(self.chunk_frames) != EMBEDDINGS_PER_WHOLE_CHUNK:
            raise ValueError(f"{model_path}: audio n_window={audio.n_window} makes {_convolved(self.chunk_frames)} "
                             f"embeddings per chunk, but transformers' Qwen3-Omni audio tower counts "
                             f"{EMBEDDINGS_PER_WHOLE_CHUNK} (n_window 50)")
        if audio.n_window_infer < self.chunk_frames:
            raise ValueError(f"{model_path}: audio n_window_infer={audio.n_window_infer} is shorter than a chunk "
                             f"({self.chunk_frames} frames)")
        self.deepstack_levels = len(hf_config.thinker_config.vision_config.deepstack_visual_indexes)

    # ---- preprocessing -------------------------------------------------------------------

    def log_mel(self, samples: np.ndarray) -> np.ndarray:
        """As Qwen3OmniMoeProcessor calls the extractor for one clip: no padding past the clip
        (the STFT's last frames see its reflection, not silence), every frame kept."""
        if samples.size <= self.feature_extractor.n_fft // 2:
            # The STFT reflects half a window at each end: a shorter clip has nothing to reflect.
            raise MediaError("invalid_audio", f"an audio clip of {samples.size * 1000 / self.sample_rate:.0f} ms is "
                             "too short for the model to hear")
        features = self.feature_extractor(samples, sampling_rate=self.sample_rate, padding=True, truncation=False,
                                          return_attention_mask=True, return_tensors="np")
        frames = int(features["attention_mask"][0].sum())
        return np.ascontiguousarray(features["input_features"][0][:, :frames], dtype=np.float32)

    def audio_embedding_count(self, num_frames: int) -> int:
        """Whole chunks make 13 embeddings each, the tail chunk what its convolutions leave
        (transformers' _get_feat_extract_output_lengths)."""
        whole, tail = divmod(num_frames, self.chunk_frames)
        return whole * EMBEDDINGS_PER_WHOLE_CHUNK + (_convolved(tail) if tail else 0)

    def embedding_size(self) -> int:
        return self.hf_config.text_config.hidden_size * (1 + self.deepstack_levels)

    def talker_row_width(self) -> int:
        return self.hf_config.text_config.hidden_size

    def talker_rows(self, hidden_states: torch.Tensor, input_embeds: torch.Tensor,
                    item_rows: torch.Tensor) -> torch.Tensor:
        """As Qwen3OmniMoeForConditionalGeneration.generate builds the talker's input: where an
        image, clip or video stood, the thinker's hidden state at the talker's layer; elsewhere
        the token's embedding (the talker projects each kind its own way)."""
        width = self.talker_row_width()
        return torch.where(item_rows.unsqueeze(-1), hidden_states, input_embeds[:, :width])

    def talker_prompt(self, prompt_token_ids: list[int], placeholders) -> TalkerPrompt:
        """The talker hears the prompt's user turns (each from its <|im_start|> to the next:
        system turns and earlier answers are dropped) and the three rows that open the answer
        (<|im_start|>assistant\n, the last such turn), then its own start rows, then the reply
        from the position after those three on. Positions are M-RoPE over that sequence, as
        transformers computes them over the talker's tokens. A prompt with no assistant turn
        (not a chat) is heard whole."""
        config = self.omni_config
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        n = len(ids)
        starts = np.flatnonzero(ids[:-1] == config.im_start_token_id)
        answers = [int(s) for s in starts if ids[s + 1] == config.assistant_token_id]
        if answers:
            cut = min(answers[-1] + 3, n)
            bounds = [*(int(s) for s in starts), n]
            kept = [(start, min(end, answers[-1])) for start, end in zip(bounds, bounds[1:])
                    if ids[start + 1] == config.user_token_id and start < answers[-1]]
            kept.append((answers[-1], cut))
        else:
            cut, kept = n, [(0, n)] if n else []
        placeholders = sorted(placeholders, key=lambda p: p.offset)
        items = [(p.offset, p.end) for p in placeholders]
        # Items in kept turns, at their offsets in the talker's sequence (one pass over both).
        shifted, dropped, previous_end, index = [], 0, 0, 0
        for start, end in kept:
            dropped += start - previous_end
            previous_end = end
            while index < len(placeholders) and placeholders[index].offset < start:
                index += 1
            while index < len(placeholders) and placeholders[index].end <= end:
                shifted.append(dataclasses.replace(placeholders[index], offset=placeholders[index].offset - dropped))
                index += 1
        length = sum(end - start for start, end in kept) + TALKER_START_CODES
        positions, delta = self.prompt_positions(length, shifted) if shifted else (None, 0)
        return TalkerPrompt(cut=cut, kept=kept, items=items, mrope_positions=positions, mrope_delta=delta)

    # ---- model side ----------------------------------------------------------------------

    def load_encoder(self, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        return load_weights_into(Qwen3OmniEncoder, self.model_path, dtype, device, attn_implementation="sdpa")

    def encode_items(self, encoder: torch.nn.Module, items: list[ProcessedItem]) -> list[torch.Tensor]:
        device = next(encoder.parameters()).device
        outputs = self._encode_images(encoder, items)
        with torch.inference_mode():
            for group in self._clip_groups(items):
                features = torch.from_numpy(np.concatenate([items[i].tower_input for i in group], axis=1)).to(device)
                frames = torch.tensor([items[i].tower_input.shape[1] for i in group], dtype=torch.long, device=device)
                rows = encoder.encode_audio(features, frames)
                # Audio adds nothing at the deepstack levels.
                rows = torch.cat([rows, rows.new_zeros(rows.shape[0], self.embedding_size() - rows.shape[1])], dim=-1)
                outputs.update(zip(group, torch.split(rows, [items[i].num_embeddings for i in group])))
        if len(outputs) != len(items):
            raise ValueError(f"items of unknown modality: {sorted({item.modality for item in items})}")
        return [outputs[i] for i in range(len(items))]

    def _clip_groups(self, items: list[ProcessedItem]) -> list[list[int]]:
        """The audio items' indices in batches whose clips the tower encodes as it would each alone.

        The tower pads every chunk of a batch to the batch's longest, and its second and third
        convolutions read that padding's convolved values: a clip shorter than a chunk, batched
        with a longer clip, comes out different (its last embeddings first). A clip of at least
        one chunk has its tail padded to a whole chunk even alone, so such clips batch together;
        a shorter one batches only with clips of its own length. An item's embeddings are then
        its own, whatever it was batched with (the encoder cache shares them across requests)."""
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            if item.modality == "audio":
                groups.setdefault(min(item.tower_input.shape[1], self.chunk_frames), []).append(i)
        return list(groups.values())

    def load_language_model(self, dtype: torch.dtype, device: torch.device | str,
                            attn_implementation: str) -> torch.nn.Module:
        model = load_weights_into(Qwen3OmniThinker, self.model_path, dtype, device)
        # The engine's paged attention in the language model (the towers are not here).
        model.thinker.model.language_model.config._attn_implementation = attn_implementation
        return model
