"""Qwen2.5-Omni's thinker: Qwen2.5-VL's images plus audio heard by the model itself.

The checkpoint holds three stages (thinker -> talker -> codec); this adapter is the thinker's
seam, as Qwen2VLAdapter is a VLM's: images as in Qwen2.5-VL (the same processor, tower and
M-RoPE positions), and audio clips as a second kind of item. A clip becomes Whisper log-mel
features (the checkpoint's feature extractor, exactly as its processor calls it), the audio
tower turns them into one embedding per 40 ms, and its positions are those of as many text
tokens (transformers' get_rope_index places audio that way when no video carries it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import WhisperFeatureExtractor
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (Qwen2_5OmniAudioEncoder,
                                                                    Qwen2_5OmniPreTrainedModel,
                                                                    Qwen2_5OmniThinkerForConditionalGeneration,
                                                                    Qwen2_5OmniVisionEncoder)

from engine.adapters.base import config_values, load_weights_into
from engine.adapters.qwen2_vl import Qwen2VLAdapter
from engine.audio_formats import resample
from engine.media import MediaError
from engine.mm_inputs import ProcessedItem
from engine.thinker_rows import TalkerPrompt


def audio_embedding_count(num_frames: int) -> int:
    """Embeddings the audio tower makes of `num_frames` mel frames: a stride-2 convolution,
    then stride-2 pooling (transformers' _get_feat_extract_output_lengths)."""
    after_convolution = (num_frames - 1) // 2 + 1
    return (after_convolution - 2) // 2 + 1


class OmniEncoder(Qwen2_5OmniPreTrainedModel):
    """The thinker's vision and audio towers under the checkpoint's names (thinker.visual,
    thinker.audio_tower), so from_pretrained loads them and skips the three language models."""

    _keys_to_ignore_on_load_unexpected = [r"^(?!thinker\.(visual|audio_tower)\.)"]

    def __init__(self, config):
        super().__init__(config)
        thinker = config.thinker_config
        self.thinker = nn.Module()
        self.thinker.visual = Qwen2_5OmniVisionEncoder._from_config(thinker.vision_config)
        self.thinker.audio_tower = Qwen2_5OmniAudioEncoder._from_config(thinker.audio_config)
        self.post_init()

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        visual = self.thinker.visual
        return visual(pixel_values.type(visual.dtype), grid_thw=grid_thw).pooler_output

    def encode_audio(self, features: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """As get_audio_features: clips' features [mel, sum(frames)] side by side in time;
        every clip's embeddings, concatenated."""
        tower = self.thinker.audio_tower
        convolved = (frames - 1) // 2 + 1
        return tower(features.type(tower.conv1.weight.dtype), feature_lens=frames,
                     aftercnn_lens=convolved).last_hidden_state


class OmniThinker(Qwen2_5OmniPreTrainedModel):
    """The thinker's language model and output layer, driven as the runner drives any model:
    forward(inputs_embeds, position_ids, logits_to_keep) -> .logits. Its towers are never
    built (the encoder process runs them), nor the talker or codec (their own stages).

    `talker_hidden_states` keeps the step's final hidden states (after the norm), which the
    talker reads."""

    # The towers (under both key layouts) and the other stages are skipped on purpose.
    _keys_to_ignore_on_load_unexpected = [r"^talker\.", r"^token2wav\.", r"^thinker\.(model\.)?(visual|audio_tower)\."]

    def __init__(self, config):
        super().__init__(config)
        # Built whole, then its towers dropped: the class owns the checkpoint's key renames.
        self.thinker = Qwen2_5OmniThinkerForConditionalGeneration._from_config(config.thinker_config)
        del self.thinker.model.visual, self.thinker.model.audio_tower
        self.talker_hidden_states: torch.Tensor | None = None
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.thinker.model.language_model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.thinker.lm_head

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = False,
                logits_to_keep: torch.Tensor | int = 0, **kwargs) -> CausalLMOutputWithPast:
        hidden = self.thinker.model.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids,
                                                   use_cache=use_cache, **kwargs).last_hidden_state
        self.talker_hidden_states = hidden
        kept = hidden[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else hidden[:, logits_to_keep]
        return CausalLMOutputWithPast(logits=self.thinker.lm_head(kept))


class Qwen2_5OmniAdapter(Qwen2VLAdapter):
    audio_placeholder_text = "<|audio_bos|><|AUDIO|><|audio_eos|>"
    image_placeholder_text = "<|vision_bos|><|IMAGE|><|vision_eos|>"

    def __init__(self, model_path: Path, hf_config):
        # The feature extractor's settings are part of every item's identity: read them first.
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(model_path)
        self.omni_config = hf_config
        # The thinker's config holds what a VLM's top-level config does (towers, token ids).
        super().__init__(model_path, hf_config.thinker_config)
        self.family = hf_config.model_type
        self.audio_token_id = hf_config.thinker_config.audio_token_id
        self.sample_rate = self.feature_extractor.sampling_rate
        # The longest clip the extractor takes whole (its processor would cut the rest off).
        self.max_audio_samples = self.feature_extractor.n_samples

    # ---- preprocessing -------------------------------------------------------------------

    def process_audio(self, samples: np.ndarray, sample_rate: int) -> ProcessedItem:
        """Named by the clip as sent (samples and rate); heard at the extractor's rate."""
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0:
            raise MediaError("invalid_audio", f"an audio clip must be non-empty mono samples, got shape {samples.shape}")
        # Its length checked before any work on it (a resample of a huge clip would be costly).
        seconds = samples.size / sample_rate
        if seconds > self.max_audio_samples / self.sample_rate:
            raise MediaError("audio_too_long", f"an audio clip of {seconds:.1f} s is longer than this model's "
                             f"{self.max_audio_samples / self.sample_rate:.0f} s window")
        mm_hash = self.audio_hash(samples, sample_rate)
        if sample_rate != self.sample_rate:
            samples = resample(samples, sample_rate, self.sample_rate)
        # Resampling may round up by a sample.
        tower_input = self.log_mel(samples[:self.max_audio_samples])
        num_embeddings = self.audio_embedding_count(tower_input.shape[1])
        if num_embeddings < 1:
            raise MediaError("invalid_audio", f"an audio clip of {seconds * 1000:.0f} ms is too short for the model "
                             "to hear (it makes no embedding)")
        return ProcessedItem(mm_hash=mm_hash, num_embeddings=num_embeddings, tower_input=tower_input, modality="audio")

    def log_mel(self, samples: np.ndarray) -> np.ndarray:
        """The clip's features [mel, frames], as Qwen2_5OmniProcessor makes them: padded to the
        whole window, then only the clip's own frames (the attention mask's) kept."""
        features = self.feature_extractor(samples, sampling_rate=self.sample_rate, padding="max_length",
                                          return_attention_mask=True, return_tensors="np")
        frames = int(features["attention_mask"][0].sum())
        return np.ascontiguousarray(features["input_features"][0][:, :frames], dtype=np.float32)

    def audio_embedding_count(self, num_frames: int) -> int:
        """Embeddings the audio tower makes of `num_frames` mel frames."""
        return audio_embedding_count(num_frames)

    def warm_up_items(self) -> list[ProcessedItem]:
        tone = np.sin(2 * np.pi * 220 * np.arange(self.sample_rate) / self.sample_rate).astype(np.float32)
        return [*super().warm_up_items(), self.process_audio(0.1 * tone, self.sample_rate)]

    def audio_hash(self, samples: np.ndarray, sample_rate: int) -> str:
        """sha256 over the model identity (towers and both processors' settings), the rate, and
        the float32 samples; the header fixes the byte count, so the encoding is unambiguous."""
        header = json.dumps({"modality": "audio", "rate": sample_rate, "samples": int(samples.size)}).encode()
        hasher = hashlib.sha256(self._identity_digest)
        hasher.update(len(header).to_bytes(8, "little"))
        hasher.update(header)
        hasher.update(np.ascontiguousarray(samples, dtype=np.float32).tobytes())
        return hasher.hexdigest()

    def max_embeddings_per_item(self) -> int:
        return max(super().max_embeddings_per_item(),
                   self.audio_embedding_count(self.max_audio_samples // self.feature_extractor.hop_length))

    def _model_identity(self) -> dict:
        return {"vision": config_values(self.hf_config.vision_config),
                "audio": config_values(self.hf_config.audio_config),
                "feature_extractor": self.feature_extractor.to_dict()}

    def talker_row_width(self) -> int:
        return self.hf_config.text_config.hidden_size

    def talker_rows(self, hidden_states: torch.Tensor, input_embeds: torch.Tensor,
                    item_rows: torch.Tensor) -> torch.Tensor:
        """As Qwen2_5OmniForConditionalGeneration.generate builds the talker's input: the
        thinker's last hidden state plus its layer-0 embedding, which is zero where an image,
        audio or video item stood (the talker hears the thinker's reading of it, not the item)."""
        return hidden_states + input_embeds.masked_fill(item_rows.unsqueeze(-1), 0)

    def talker_prompt(self, prompt_token_ids: list[int], placeholders) -> TalkerPrompt:
        """The talker hears the whole prompt, then the speaker's text-bos row, then the reply;
        its positions are the thinker's plus two (those rows and the reply's first)."""
        n = len(prompt_token_ids)
        positions, delta = self.prompt_positions(n + 2, placeholders) if placeholders else (None, 0)
        return TalkerPrompt(cut=n, kept=[(0, n)] if n else [], mrope_positions=positions, mrope_delta=delta)

    # ---- model side ----------------------------------------------------------------------

    def load_encoder(self, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        return load_weights_into(OmniEncoder, self.model_path, dtype, device, attn_implementation="sdpa")

    def _encode_images(self, encoder: torch.nn.Module, items: list[ProcessedItem]) -> dict[int, torch.Tensor]:
        """The image items' rows, by their index in `items`, from one vision-tower call."""
        device = next(encoder.parameters()).device
        outputs: dict[int, torch.Tensor] = {}
        images = [(i, item) for i, item in enumerate(items) if item.modality == "image"]
        with torch.inference_mode():
            if images:
                pixel_values = torch.from_numpy(np.concatenate([item.tower_input for _, item in images])).to(device)
                grid_thw = torch.tensor([item.grid for _, item in images], dtype=torch.long, device=device)
                rows = encoder.encode_images(pixel_values, grid_thw)
                outputs.update(zip((i for i, _ in images), torch.split(rows, [it.num_embeddings for _, it in images])))
        return outputs

    def encode_items(self, encoder: torch.nn.Module, items: list[ProcessedItem]) -> list[torch.Tensor]:
        device = next(encoder.parameters()).device
        outputs = self._encode_images(encoder, items)
        clips = [(i, item) for i, item in enumerate(items) if item.modality == "audio"]
        with torch.inference_mode():
            if clips:
                features = torch.from_numpy(np.concatenate([item.tower_input for _, item in clips], axis=1)).to(device)
                frames = torch.tensor([item.tower_input.shape[1] for _, item in clips], dtype=torch.long, device=device)
                rows = encoder.encode_audio(features, frames)
                outputs.update(zip((i for i, _ in clips), torch.split(rows, [it.num_embeddings for _, it in clips])))
        if len(outputs) != len(items):
            raise ValueError(f"items of unknown modality: {sorted({item.modality for item in items})}")
        return [outputs[i] for i in range(len(items))]

    def load_language_model(self, dtype: torch.dtype, device: torch.device | str,
                            attn_implementation: str) -> torch.nn.Module:
        model = load_weights_into(OmniThinker, self.model_path, dtype, device)
        # The engine's paged attention in the language model (the towers are not here).
        model.thinker.model.language_model.config._attn_implementation = attn_implementation
        return model
