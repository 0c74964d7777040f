"""LLaVA with a CLIP vision tower: fixed-size images, 1-D positions.

Every image is resized and center-cropped to the tower's size, so every image makes the same
number of embeddings: one per patch, plus CLS, minus CLS again under the "default" feature
strategy (the checkpoints llava-hf ships).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import torch
from torch import nn
from transformers import AutoModel, LlavaForConditionalGeneration
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector, LlavaPreTrainedModel

from engine.adapters.base import ModelAdapter, config_values, load_weights_into
from engine.mm_inputs import ProcessedItem


class LlavaVisionEncoder(LlavaPreTrainedModel):
    """The tower and projector under the names the full model gives them, so from_pretrained
    loads their weights (with LLaVA's key renames) and skips the language model."""

    # The language model's weights are skipped on purpose: not worth a load report line each.
    _keys_to_ignore_on_load_unexpected = [r"^(?!.*(vision_tower|multi_modal_projector)\.)"]

    def __init__(self, config):
        super().__init__(config)
        self.model = nn.Module()
        self.model.vision_tower = AutoModel.from_config(config.vision_config)
        self.model.multi_modal_projector = LlavaMultiModalProjector(config)
        self.post_init()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # As LlavaModel.get_image_features: one hidden layer (or several, concatenated), CLS
        # dropped under "default", through the projector. [images, embeddings, text hidden].
        config = self.config
        tower = self.model.vision_tower
        hidden_states = tower(pixel_values.type(tower.dtype), output_hidden_states=True).hidden_states
        layers = config.vision_feature_layer
        selected = [hidden_states[layer] for layer in ([layers] if isinstance(layers, int) else layers)]
        if config.vision_feature_select_strategy == "default":
            selected = [states[:, 1:] for states in selected]
        return self.model.multi_modal_projector(torch.cat(selected, dim=-1))


class LlavaAdapter(ModelAdapter):
    family = "llava"
    image_placeholder_text = "<image>"
    uses_mrope = False

    def __init__(self, model_path: Path, hf_config):
        super().__init__(model_path, hf_config)
        self.image_token_id = hf_config.image_token_id
        vision = hf_config.vision_config
        # CLIP towers prepend a CLS token (SigLIP ones do not); "default" drops it again.
        extra = 1 if vision.model_type == "clip_vision_model" else 0
        if hf_config.vision_feature_select_strategy == "default":
            extra -= 1
        self._extra_embeddings = extra

    def _embeddings_for(self, height: int, width: int) -> int:
        patch = self.hf_config.vision_config.patch_size
        return (height // patch) * (width // patch) + self._extra_embeddings

    def process_image(self, image: PIL.Image.Image) -> ProcessedItem:
        # The processor converts to RGB, resizes the short side, center-crops: [3, H, W].
        pixel_values = np.asarray(self.image_processor(images=[image])["pixel_values"][0], dtype=np.float32)
        return ProcessedItem(mm_hash=self.mm_hash(image), tower_input=pixel_values,
                             num_embeddings=self._embeddings_for(*pixel_values.shape[-2:]))

    def max_embeddings_per_item(self) -> int:
        # The tower only takes its own image size (no position interpolation): every image is this.
        size = self.hf_config.vision_config.image_size
        return self._embeddings_for(size, size)

    def _model_identity(self) -> dict:
        config = self.hf_config
        return {"vision": config_values(config.vision_config),
                "vision_feature_layer": config.vision_feature_layer,
                "vision_feature_select_strategy": config.vision_feature_select_strategy,
                "projector_hidden_act": config.projector_hidden_act,
                "multimodal_projector_bias": config.multimodal_projector_bias}

    def load_encoder(self, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        return load_weights_into(LlavaVisionEncoder, self.model_path, dtype, device, attn_implementation="sdpa")

    def encode_items(self, encoder: torch.nn.Module, images: list[ProcessedItem]) -> list[torch.Tensor]:
        device = next(encoder.parameters()).device
        pixel_values = torch.from_numpy(np.stack([image.tower_input for image in images])).to(device)
        with torch.inference_mode():
            embeddings = encoder(pixel_values)
        return list(embeddings.unbind(0))

    def load_language_model(self, dtype: torch.dtype, device: torch.device | str,
                            attn_implementation: str) -> torch.nn.Module:
        model = LlavaForConditionalGeneration.from_pretrained(
            self.model_path, dtype=dtype, device_map=torch.device(device),
            attn_implementation={"text_config": attn_implementation, "vision_config": "sdpa"})
        # Driven with inputs_embeds, the model never touches the tower: free its memory.
        del model.model.vision_tower, model.model.multi_modal_projector
        return model.eval()
