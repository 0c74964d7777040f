"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution images, 3-D M-RoPE positions.

An image is resized to a multiple of 28 pixels (14-pixel patches, merged 2x2 into one
embedding), so its embedding count depends on its size. The two versions differ only inside
the vision tower (2.5 adds window attention); preprocessing, placeholders and positions are
the same.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from torch import nn
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VisionTransformerPretrainedModel,
                                                                Qwen2_5_VLPreTrainedModel)
from transformers.models.qwen2_vl.modeling_qwen2_vl import (Qwen2VisionTransformerPretrainedModel,
                                                            Qwen2VLPreTrainedModel)

from engine.adapters.base import ModelAdapter, load_weights_into
from engine.mm_inputs import ProcessedItem
from engine.request import MultiModalPlaceholder

# The real processor refuses images more elongated than this (smart_resize).
MAX_ASPECT_RATIO = 200


def _vision_only_class(pretrained_base, tower_class):
    """A model holding only `model.visual`, named as in the full model, so from_pretrained
    loads the tower's weights (with the family's key renames) and skips the language model."""

    class QwenVisionEncoder(pretrained_base):
        # The language model's weights are skipped on purpose: not worth a load report line each.
        _keys_to_ignore_on_load_unexpected = [r"^(?!.*visual\.)"]

        def __init__(self, config):
            super().__init__(config)
            self.model = nn.Module()
            self.model.visual = tower_class._from_config(config.vision_config)
            self.post_init()

        def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
            # As Qwen2VLModel.get_image_features: merged embeddings of all images, concatenated.
            visual = self.model.visual
            return visual(pixel_values.type(visual.dtype), grid_thw=grid_thw).pooler_output

    return QwenVisionEncoder


_MODELS = {
    "qwen2_vl": (Qwen2VLForConditionalGeneration,
                 _vision_only_class(Qwen2VLPreTrainedModel, Qwen2VisionTransformerPretrainedModel)),
    "qwen2_5_vl": (Qwen2_5_VLForConditionalGeneration,
                   _vision_only_class(Qwen2_5_VLPreTrainedModel, Qwen2_5_VisionTransformerPretrainedModel)),
}


class Qwen2VLAdapter(ModelAdapter):
    image_placeholder_text = "<|vision_start|><|image_pad|><|vision_end|>"
    uses_mrope = True

    def __init__(self, model_path: Path, hf_config):
        self.family = hf_config.model_type
        super().__init__(model_path, hf_config)
        self.image_token_id = hf_config.image_token_id
        self.merge_size = hf_config.vision_config.spatial_merge_size
        # The processor lays patches out for the tower's patch and merge sizes; a mismatch would
        # make wrong embedding counts, caught here rather than as a shape error in the encoder.
        vision, processor = hf_config.vision_config, self.image_processor
        if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != (
                vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise ValueError(f"{model_path}: the image processor's patch/merge/temporal sizes "
                             f"({processor.patch_size}, {processor.merge_size}, {processor.temporal_patch_size}) "
                             f"differ from the vision tower's ({vision.patch_size}, {vision.spatial_merge_size}, "
                             f"{vision.temporal_patch_size})")

    # ---- preprocessing -------------------------------------------------------------------

    def process_image(self, image: PIL.Image.Image) -> ProcessedItem:
        # The processor converts to RGB itself (transparency onto white) and patchifies:
        # pixel_values [patches, 3 * temporal_patch * 14 * 14], grid (t, h, w) in patches.
        out = self.image_processor(images=[image])
        grid = tuple(int(n) for n in out["image_grid_thw"][0])
        return ProcessedItem(mm_hash=self.mm_hash(image), num_embeddings=math.prod(grid) // self.merge_size ** 2,
                             tower_input=np.asarray(out["pixel_values"], dtype=np.float32), grid=grid)

    def max_embeddings_per_item(self) -> int:
        """An upper bound over every image the processor accepts, following smart_resize's
        three cases (factor f = patch * merge pixels per embedding side):
        - kept or shrunk with both sides >= f: at most max_pixels / f^2 embeddings;
        - shrunk with the short side clamped to f: one row of at most sqrt(200 * max_pixels) / f;
        - grown to min_pixels, each side rounded up: at most (a + 1)(b + 1) with a * b = min_pixels / f^2
          and a / b <= 200.
        The middle case is why a very elongated image can beat the max_pixels count on small settings."""
        processor = self.image_processor
        factor = processor.patch_size * processor.merge_size
        min_pixels, max_pixels = processor.size["shortest_edge"], processor.size["longest_edge"]
        kept = max_pixels // factor ** 2
        clamped = math.isqrt(MAX_ASPECT_RATIO * max_pixels) // factor
        long_side = math.sqrt(MAX_ASPECT_RATIO * min_pixels) / factor
        grown = math.floor(min_pixels / factor ** 2 + long_side + min_pixels / factor ** 2 / long_side + 1)
        return max(kept, clamped, grown)

    # ---- model side ----------------------------------------------------------------------

    def load_encoder(self, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        _, encoder_class = _MODELS[self.family]
        return load_weights_into(encoder_class, self.model_path, dtype, device, attn_implementation="sdpa")

    def encode_items(self, encoder: torch.nn.Module, images: list[ProcessedItem]) -> list[torch.Tensor]:
        device = next(encoder.parameters()).device
        pixel_values = torch.from_numpy(np.concatenate([image.tower_input for image in images])).to(device)
        grid_thw = torch.tensor([image.grid for image in images], dtype=torch.long, device=device)
        with torch.inference_mode():
            embeddings = encoder(pixel_values, grid_thw)
        return list(torch.split(embeddings, [image.num_embeddings for image in images]))

    def load_language_model(self, dtype: torch.dtype, device: torch.device | str,
                            attn_implementation: str) -> torch.nn.Module:
        model_class, _ = _MODELS[self.family]
        model = model_class.from_pretrained(
            self.model_path, dtype=dtype, device_map=torch.device(device),
            attn_implementation={"text_config": attn_implementation, "vision_config": "sdpa"})
        # Driven with inputs_embeds, the model never touches the tower: free its memory.
        del model.model.visual
        return model.eval()

    def prompt_positions(self, num_prompt_tokens: int,
                         placeholders: list[MultiModalPlaceholder]) -> tuple[np.ndarray, int]:
        """As transformers' get_rope_index: text advances all three axes together by one per
        token; an image's embeddings take (t, row, column) offsets from the position where it
        starts, and the text after it resumes at that start + max(rows, columns). Audio (an
        omni model's) is placed as text is: one position per embedding on all three axes."""
        positions = np.empty((3, num_prompt_tokens), dtype=np.int64)
        next_position = 0
        text_start = 0
        images = [p for p in placeholders if p.modality == "image"]
        for placeholder in sorted(images, key=lambda p: p.offset):
            if placeholder.offset < text_start or placeholder.end > num_prompt_tokens:
                raise ValueError(f"placeholder at {placeholder.offset}..{placeholder.end} overlaps another "
                                 f"or ends past the prompt ({num_prompt_tokens} tokens)")
            text_length = placeholder.offset - text_start
            positions[:, text_start:placeholder.offset] = next_position + np.arange(text_length)
            next_position += text_length
            t, h, w = placeholder.grid
            h, w = h // self.merge_size, w // self.merge_size
            if t * h * w != placeholder.length:
                raise ValueError(f"placeholder of {placeholder.length} tokens does not match its grid "
                                 f"{placeholder.grid} (merge {self.merge_size})")
            # Images are one temporal step (the frame repeated over temporal_patch_size).
            grid = np.indices((t, h, w)).reshape(3, -1)
            positions[:, placeholder.offset:placeholder.end] = next_position + grid
            next_position += max(h, w)
            text_start = placeholder.end
        positions[:, text_start:] = next_position + np.arange(num_prompt_tokens - text_start)
        delta = int(positions.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0
        return positions, delta
