"""Reference outputs for vision-language checkpoints from transformers' own processor and model.

`prompt_text` is what the chat template renders: the family's placeholder text once per image
(Qwen2-VL: <|vision_start|><|image_pad|><|vision_end|>, LLaVA: <image>). transformers'
processor expands it and makes the pixel values; the model's `generate` gives greedy tokens.
"""

from __future__ import annotations

import functools
from pathlib import Path

import PIL.Image
import torch
from transformers import (AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer, BatchFeature,
                          LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration,
                          Qwen2VLForConditionalGeneration, Qwen2VLProcessor)

MODEL_CLASSES = {
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "llava": LlavaForConditionalGeneration,
}


class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
    """The stock Qwen2-VL processor always builds a video processor, which needs torchvision
    (never installed on CPU hosts). Images only: the same placeholder expansion and
    mm_token_type_ids, no video processor."""

    attributes = ["image_processor", "tokenizer"]

    def __init__(self, image_processor, tokenizer, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                         chat_template=chat_template, **kwargs)


def _model_type(path: Path) -> str:
    return AutoConfig.from_pretrained(path).model_type


@functools.cache
def load_processor(path: Path):
    if _model_type(path) == "llava":
        # The folder's processor_config.json says num_additional_image_tokens=1 (CLIP's CLS).
        return AutoProcessor.from_pretrained(path, backend="pil")
    return Qwen2VLImageOnlyProcessor(AutoImageProcessor.from_pretrained(path, backend="pil"),
                                     AutoTokenizer.from_pretrained(path))


@functools.cache
def load_reference_vlm(path: Path):
    model = MODEL_CLASSES[_model_type(path)].from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    # Generate every requested token, like the engine's ignore_eos.
    model.generation_config.eos_token_id = None
    return model


def hf_processor_inputs(path: Path, prompt_text: str, images: list[PIL.Image.Image]) -> BatchFeature:
    """What transformers' processor makes of the prompt and images (torch tensors, batch of 1):
    input_ids with placeholders expanded, pixel_values, and for Qwen image_grid_thw and
    mm_token_type_ids."""
    return load_processor(path)(text=[prompt_text], images=images or None, return_tensors="pt")


def hf_expanded_prompt(path: Path, prompt_text: str, images: list[PIL.Image.Image]) -> list[int]:
    return hf_processor_inputs(path, prompt_text, images)["input_ids"][0].tolist()


def hf_vlm_greedy(path: Path, prompt_text: str, images: list[PIL.Image.Image], max_new_tokens: int) -> list[int]:
    inputs = hf_processor_inputs(path, prompt_text, images)
    out = load_reference_vlm(path).generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
