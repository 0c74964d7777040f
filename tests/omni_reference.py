"""Reference outputs for omni checkpoints from transformers' own processor and model.

`prompt_text` is what the chat template renders: the family's placeholder text once per image
and per audio clip. transformers' Qwen2.5-Omni processor expands it and makes the pixel values
and log-mel features; the full model's `generate` gives the thinker's greedy tokens.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from transformers import (AutoImageProcessor, AutoTokenizer, Qwen2_5OmniForConditionalGeneration,
                          Qwen2_5OmniProcessor, WhisperFeatureExtractor)


class Qwen2_5OmniNoVideoProcessor(Qwen2_5OmniProcessor):
    """The stock processor wants a video processor, which needs torchvision (never installed on
    CPU hosts). Images and audio only: the same placeholder expansion, no video processor."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


@functools.cache
def load_processor(path: Path) -> Qwen2_5OmniNoVideoProcessor:
    return Qwen2_5OmniNoVideoProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path, backend="pil"), video_processor=None,
        feature_extractor=WhisperFeatureExtractor.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path))


@functools.cache
def load_reference_omni(path: Path) -> Qwen2_5OmniForConditionalGeneration:
    return Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()


def hf_omni_inputs(path: Path, prompt_text: str, images: list[PIL.Image.Image], clips: list[np.ndarray]):
    media = {}
    if images:
        media["images"] = images
    if clips:
        media["audio"] = clips
    return load_processor(Path(path))(text=[prompt_text], return_tensors="pt", **media)


def hf_omni_thinker_greedy(path: Path, prompt_text: str, images: list[PIL.Image.Image], clips: list[np.ndarray],
                           max_new_tokens: int) -> list[int]:
    """The thinker's greedy tokens for the prompt, every requested one (no stop at EOS)."""
    inputs = hf_omni_inputs(path, prompt_text, images, clips)
    with torch.no_grad():
        out = load_reference_omni(Path(path)).generate(
            **inputs, generation_mode="text", thinker_max_new_tokens=max_new_tokens, thinker_do_sample=False,
            thinker_eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
