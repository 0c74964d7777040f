"""Reference outputs for omni checkpoints from transformers' own processor and model.

`prompt_text` is what the chat template renders: the family's placeholder text once per image
and per audio clip. transformers' processor for the checkpoint's family (Qwen2.5-Omni or
Qwen3-Omni, read from its config.json) expands it and makes the pixel values and log-mel
features; the full model's `generate` gives the thinker's greedy tokens.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from transformers import (AutoImageProcessor, AutoTokenizer, Qwen2_5OmniForConditionalGeneration,
                          Qwen2_5OmniProcessor, Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor,
                          WhisperFeatureExtractor)


class _WithoutVideo:
    """The stock processors want a video processor, which needs torchvision (never installed on
    CPU hosts). Images and audio only: the same placeholder expansion, no video processor."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


class Qwen2_5OmniNoVideoProcessor(_WithoutVideo, Qwen2_5OmniProcessor):
    pass


class Qwen3OmniNoVideoProcessor(_WithoutVideo, Qwen3OmniMoeProcessor):
    pass


# By config.json's model_type: the processor and the full model.
FAMILIES = {
    "qwen2_5_omni": (Qwen2_5OmniNoVideoProcessor, Qwen2_5OmniForConditionalGeneration),
    "qwen3_omni_moe": (Qwen3OmniNoVideoProcessor, Qwen3OmniMoeForConditionalGeneration),
}


def _family(path: Path) -> tuple[type, type]:
    return FAMILIES[json.loads((Path(path) / "config.json").read_text())["model_type"]]


@functools.cache
def load_processor(path: Path):
    processor_class, _ = _family(path)
    return processor_class(
        image_processor=AutoImageProcessor.from_pretrained(path, backend="pil"), video_processor=None,
        feature_extractor=WhisperFeatureExtractor.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path))


@functools.cache
def load_reference_omni(path: Path):
    _, model_class = _family(path)
    return model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


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


def _keep_attention_mask(module, args, kwargs):
    """transformers 5.23's generate drops an all-ones attention mask before the forward, and
    Qwen2.5-Omni's talker adds its codec pad/bos embeddings and takes its M-RoPE positions only
    when a mask is given (a padded batch gets them; a single prompt does not). The model's own
    code means them to be there: give the talker the mask back."""
    if kwargs.get("attention_mask") is None:
        cache = kwargs.get("past_key_values")
        past = cache.get_seq_length() if cache is not None else 0
        inputs = kwargs.get("inputs_embeds")
        new = (inputs if inputs is not None else kwargs["input_ids"]).shape[1]
        kwargs["attention_mask"] = torch.ones(1, past + new, dtype=torch.long)
    return args, kwargs


def hf_omni_spoken_greedy(path: Path, prompt_text: str, images: list, clips: list, max_new_tokens: int,
                          max_codes: int, speaker: str, seed: int, repetition_penalty: float = 1.0
                          ) -> tuple[list[int], list, torch.Tensor]:
    """The thinker's greedy tokens, the talker's greedy codes (with `repetition_penalty`) and
    the codec's waveform. Qwen2.5-Omni: codes are ints, and the codec's noise is drawn after
    torch.manual_seed(seed); Qwen3-Omni: codes are frames (a list of code groups per step), and
    code2wav draws no noise."""
    model = load_reference_omni(Path(path))
    qwen3 = hasattr(model, "code2wav")
    if not getattr(model, "_antiphon_mask_hook", False):
        model.talker.register_forward_pre_hook(_keep_attention_mask, with_kwargs=True)
        model._antiphon_mask_hook = True
    if qwen3 and not hasattr(model.talker.config, "audio_config"):
        # transformers 5.23: the talker's get_rope_index reads audio_config.n_window from the
        # talker's own config, which has none (a prompt with a clip fails there); it is the
        # thinker's audio tower's.
        model.talker.config.audio_config = model.config.thinker_config.audio_config
    captured = {}
    codec, method = (model.code2wav, "chunked_decode") if qwen3 else (model.token2wav, "forward")
    decode = getattr(codec, method)

    def codes_then_decode(code, **kwargs):
        captured["codes"] = code[0].T.tolist() if qwen3 else code[0].tolist()
        torch.manual_seed(seed)
        return decode(code, **kwargs)

    setattr(codec, method, codes_then_decode)
    try:
        inputs = dict(hf_omni_inputs(path, prompt_text, images, clips))
        # Unprefixed, the pixels would reach the talker too, whose generate refuses them; the
        # talker takes the image grids (for its positions) under its own prefix.
        if "pixel_values" in inputs:
            inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
            inputs["talker_image_grid_thw"] = inputs["thinker_image_grid_thw"] = inputs.pop("image_grid_thw")
        with torch.no_grad():
            sequences, waveform = model.generate(
                **inputs, speaker=speaker, thinker_max_new_tokens=max_new_tokens, thinker_do_sample=False,
                thinker_eos_token_id=None, talker_max_new_tokens=max_codes, talker_do_sample=False,
                talker_repetition_penalty=repetition_penalty)
    finally:
        setattr(codec, method, decode)
    return sequences[0, inputs["input_ids"].shape[1]:].tolist(), captured["codes"], waveform.reshape(-1)
