"""What the engine needs to know about a multimodal family, in one object per checkpoint.

The engine splits such a model in two: the towers (vision, and audio for an omni model) run in
the encoder process, the language model in the decoder. The adapter is the seam between them
and the frontend:

- preprocessing (CPU, no weights; the frontend's pool and the offline API): turn an image or an
  audio clip into what its tower takes, a content hash, and a count of embeddings; expand the
  chat template's one placeholder token per item into as many tokens as the item has embeddings.
- model side (torch): load only the part each process needs, encode a batch of items, and say
  where prompt tokens sit (M-RoPE for Qwen2-VL) so the decoder can drive the language model
  with `inputs_embeds` and get what the full model computes with pixel values or audio features.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from transformers import AutoImageProcessor

from engine.mm_inputs import PlaceholderMismatch, ProcessedItem
from engine.request import MultiModalPlaceholder


class ModelAdapter:
    family: str = ""
    # The token the chat template writes once per image, and the template's text for one image.
    image_token_id: int
    image_placeholder_text: str
    # The same for an audio clip, in a family whose model hears audio itself (None: it does not).
    audio_token_id: int | None = None
    audio_placeholder_text: str = ""
    # Whether positions are 3-D (time, height, width) M-RoPE; then `prompt_positions` gives them.
    uses_mrope: bool = False

    def __init__(self, model_path: Path, hf_config):
        """Reads the image processor's settings from the folder; loads no weights, so the
        frontend can build one per preprocessing worker cheaply."""
        self.model_path = Path(model_path)
        self.hf_config = hf_config
        # The PIL backend: the torchvision one must never be needed (it is not installed on CPU hosts).
        self.image_processor = AutoImageProcessor.from_pretrained(self.model_path, backend="pil")
        # Everything but the image that decides its embeddings, hashed once: every image hash
        # starts from it, so a changed processor setting or tower config never reuses an entry.
        identity = {"family": self.family, "model": self._model_identity(),
                    "processor": json.loads(self.image_processor.to_json_string())}
        self._identity_digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()

    # ---- preprocessing -------------------------------------------------------------------

    def process_image(self, image: PIL.Image.Image) -> ProcessedItem:
        raise NotImplementedError

    def warm_up_items(self) -> list[ProcessedItem]:
        """One plain item per modality the model takes (a mid-sized image first), for the
        encoder's start-up warm-up: the first real request of each kind pays no lazy set-up."""
        return [self.process_image(PIL.Image.new("RGB", (224, 224), (127, 127, 127)))]

    def mm_hash(self, image: PIL.Image.Image) -> str:
        """sha256 over the model identity, the processor settings, and the decoded image as
        given: mode, size, palette and transparency (RGB conversion composites transparency
        onto white, so they change the pixels the tower sees) and the raw pixel bytes. The
        header fixes the byte count, so the encoding is unambiguous."""
        header = {"mode": image.mode, "size": list(image.size),
                  "palette": image.getpalette() if image.mode in ("P", "PA") else None,
                  "transparency": repr(image.info.get("transparency"))}
        encoded_header = json.dumps(header, sort_keys=True).encode()
        hasher = hashlib.sha256(self._identity_digest)
        hasher.update(len(encoded_header).to_bytes(8, "little"))
        hasher.update(encoded_header)
        hasher.update(image.tobytes())
        return hasher.hexdigest()

    def process_audio(self, samples: np.ndarray, sample_rate: int) -> ProcessedItem:
        """A mono clip (float32 in [-1, 1]) as the audio tower takes it; only families that hear."""
        raise ValueError("this model takes no audio")

    def placeholder_tokens(self) -> dict[str, tuple[int, str]]:
        """By modality: the token the chat template writes once per item, and its text for one item."""
        tokens = {"image": (self.image_token_id, self.image_placeholder_text)}
        if self.audio_token_id is not None:
            tokens["audio"] = (self.audio_token_id, self.audio_placeholder_text)
        return tokens

    def expand_placeholders(self, token_ids: list[int],
                            items: list[ProcessedItem]) -> tuple[list[int], list[MultiModalPlaceholder]]:
        """Repeat each placeholder token `items[k].num_embeddings` times and say where each
        item's rows are. The k-th placeholder of a modality is the k-th item of that modality
        in `items`, as the chat template wrote them (images and audio may interleave)."""
        tokens = self.placeholder_tokens()
        modality_of = {token: modality for modality, (token, _) in tokens.items()}
        queues = {modality: [item for item in items if item.modality == modality] for modality in tokens}
        unknown = sorted({item.modality for item in items} - set(tokens))
        if unknown:
            raise PlaceholderMismatch(f"this model takes no {', '.join(unknown)}")
        positions = [i for i, token in enumerate(token_ids) if token in modality_of]
        for modality, (token, text) in tokens.items():
            written = sum(1 for i in positions if token_ids[i] == token)
            if written != len(queues[modality]):
                raise PlaceholderMismatch(f"the prompt holds {written} {modality} placeholder(s) ({text!r}) but "
                                          f"{len(queues[modality])} {modality} item(s) were given")
        expanded: list[int] = []
        placeholders: list[MultiModalPlaceholder] = []
        next_item = {modality: iter(queue) for modality, queue in queues.items()}
        start = 0
        for position in positions:
            token = token_ids[position]
            item = next(next_item[modality_of[token]])
            expanded.extend(token_ids[start:position])
            placeholders.append(MultiModalPlaceholder(offset=len(expanded), length=item.num_embeddings,
                                                      mm_hash=item.mm_hash, modality=item.modality,
                                                      grid=item.grid))
            expanded.extend([token] * item.num_embeddings)
            start = position + 1
        expanded.extend(token_ids[start:])
        return expanded, placeholders

    def max_embeddings_per_item(self) -> int:
        """The most embeddings one item can make under these processor settings: sizes the
        encoder cache (it must hold at least one item)."""
        raise NotImplementedError

    def embedding_size(self) -> int:
        return self.hf_config.text_config.hidden_size

    # ---- model side ----------------------------------------------------------------------

    def load_encoder(self, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """Only the towers (+ projector), with the checkpoint's weights (the encoder process
        never allocates the language model)."""
        raise NotImplementedError

    def encode_items(self, encoder: torch.nn.Module, items: list[ProcessedItem]) -> list[torch.Tensor]:
        """One forward for the batch (per tower); one [num_embeddings, embedding_size()] tensor
        per item, in order: the rows that replace its placeholder tokens."""
        raise NotImplementedError

    def load_language_model(self, dtype: torch.dtype, device: torch.device | str,
                            attn_implementation: str) -> torch.nn.Module:
        """The model whose forward(inputs_embeds=[1, T, H], position_ids=..., ...) gives .logits,
        its text attention `attn_implementation`, its towers dropped."""
        raise NotImplementedError

    def talker_row_width(self) -> int | None:
        """An omni model's: the width of the per-position rows its talker consumes (the decoder
        keeps them in a hidden-state store); None for a model without a talker."""
        return None

    def talker_rows(self, hidden_states: torch.Tensor, input_embeds: torch.Tensor,
                    item_rows: torch.Tensor) -> torch.Tensor:
        """The talker's rows for a step's positions [T, talker_row_width()], from the thinker's
        final hidden states [T, H], its input embeddings [T, H] and which rows were items' [T]."""
        raise NotImplementedError(f"{self.family} has no talker")

    def talker_prompt(self, prompt_token_ids: list[int], placeholders: list[MultiModalPlaceholder]):
        """An omni model's: how its talker's prompt is made of this thinker prompt
        (engine/thinker_rows.py TalkerPrompt)."""
        raise NotImplementedError(f"{self.family} has no talker")

    def prompt_positions(self, num_prompt_tokens: int,
                         placeholders: list[MultiModalPlaceholder]) -> tuple[np.ndarray, int]:
        """M-RoPE families only: [3, num_prompt_tokens] int64 positions of the prompt and the
        delta that places a later token t at t + delta on every axis."""
        raise NotImplementedError(f"{self.family} uses 1-D positions")

    # ---- for subclasses ------------------------------------------------------------------

    def _model_identity(self) -> dict:
        """The checkpoint's config values that change an image's embeddings (the vision tower's
        config by default). Weights are not hashed: one engine serves one checkpoint."""
        return config_values(self.hf_config.vision_config)


def config_values(config) -> dict:
    # Private keys (`_name_or_path`...) and the version stamp say nothing about embeddings.
    return {key: value for key, value in config.to_dict().items()
            if not key.startswith("_") and key != "transformers_version"}


def load_weights_into(model_class, model_path: Path, dtype: torch.dtype, device, **kwargs) -> torch.nn.Module:
    """from_pretrained for a class that holds only part of a checkpoint (a vision tower): the
    checkpoint's other weights are skipped, never allocated. transformers still applies its
    key renames for the family (old and new checkpoint layouts). A weight the part declares
    but the checkpoint lacks would be silently random: that is an error here."""
    model, info = model_class.from_pretrained(model_path, dtype=dtype, device_map=torch.device(device),
                                              output_loading_info=True, **kwargs)
    missing = list(info.get("missing_keys", ()))
    if missing:
        raise ValueError(f"{model_path}: the checkpoint lacks vision weights {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return model.eval()
