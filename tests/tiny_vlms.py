"""Tiny random-weight vision-language checkpoints of real architectures, saved as Hugging Face folders.

Each folder holds what a real checkpoint holds: config + weights, a tokenizer with the family's
special tokens and a chat template that renders image parts the way the real template does, and
the image processor's config. The sizes are chosen so a forward takes milliseconds on a CPU
(2 layers, hidden 64, a few hundred tokens of vocabulary, images of a dozen embeddings).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast,
                          Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil)

from tests.tiny_models import build_tokenizer

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")

QWEN_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_IMAGE_PLACEHOLDER = "<image>"


def _chat_template(image_placeholder: str) -> str:
    """ChatML, where a message's content is a string or a list of parts: an image part (as the
    real templates accept it: type "image" or "image_url", or an "image" key) becomes the
    family's placeholder text, a text part its text, in the order given."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] in ('image', 'image_url') or 'image' in part %}" + image_placeholder +
        "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def build_vlm_tokenizer(family: str) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    special = QWEN_SPECIAL_TOKENS if family.startswith("qwen") else [LLAVA_IMAGE_PLACEHOLDER]
    tokenizer.add_tokens(special, special_tokens=True)
    placeholder = QWEN_IMAGE_PLACEHOLDER if family.startswith("qwen") else LLAVA_IMAGE_PLACEHOLDER
    tokenizer.chat_template = _chat_template(placeholder)
    return tokenizer


def _text_config(tokenizer: PreTrainedTokenizerFast, **extra) -> dict:
    return dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        # Wider than the default 0.02 so logits are decisive and greedy choices are not ties.
        initializer_range=0.2, **extra,
    )


def _qwen_model(family: str, tokenizer: PreTrainedTokenizerFast):
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(QWEN_SPECIAL_TOKENS)))
    # head_dim 16: the three M-RoPE sections (time, height, width) must sum to head_dim / 2.
    text = _text_config(tokenizer, use_sliding_window=False,
                        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    common_vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                         initializer_range=0.2)
    if family == "qwen2_vl":
        # Qwen2-VL: embed_dim is the tower's width, hidden_size the text width the merger projects to.
        vision = dict(common_vision, embed_dim=32, hidden_size=64)
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    else:
        # Qwen2.5-VL: hidden_size is the tower's width, out_hidden_size the text width. Windows of
        # 56 pixels = 2x2 merged patches, so a 112x84 image spans several windows (padding included);
        # block 1 attends over the whole image.
        vision = dict(common_vision, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                      window_size=56, fullatt_block_indexes=[1])
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    return model_class(config)


def _llava_model(tokenizer: PreTrainedTokenizerFast):
    # CLIP tower at 56x56 with 14-pixel patches: 16 patches + CLS; "default" drops CLS -> 16 embeddings.
    vision = CLIPVisionConfig(image_size=56, patch_size=14, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, projection_dim=32,
                              initializer_range=0.2)
    text = LlamaConfig(**_text_config(tokenizer), tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_PLACEHOLDER),
                         image_seq_length=16, vision_feature_layer=-2, vision_feature_select_strategy="default",
                         tie_word_embeddings=False)
    return LlavaForConditionalGeneration(config)


def save_tiny_vlm(family: str, folder: Path, seed: int = 0) -> Path:
    """Save a tiny random `family` checkpoint (one of FAMILIES) into `folder`; returns `folder`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    folder = Path(folder)
    tokenizer = build_vlm_tokenizer(family)
    torch.manual_seed(seed)
    if family == "llava":
        model = _llava_model(tokenizer)
        image_processor = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    else:
        model = _qwen_model(family, tokenizer)
        # 28x28 pixels is one embedding (14-pixel patches merged 2x2); at most 16 embeddings an image.
        image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=16 * 28 * 28,
                                                   patch_size=14, merge_size=2, temporal_patch_size=2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if family == "llava":
        # What llava-hf checkpoints ship: the processor config says how many tokens an image takes
        # (patches + CLS, minus CLS again under the "default" feature strategy).
        LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                       vision_feature_select_strategy="default", num_additional_image_tokens=1,
                       chat_template=tokenizer.chat_template).save_pretrained(folder)
    else:
        # The stock Qwen2-VL processor needs a video processor (torchvision): save the parts.
        image_processor.save_pretrained(folder)
    return folder
