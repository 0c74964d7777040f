"""Tiny random-weight omni checkpoints (thinker -> talker -> codec), saved as Hugging Face folders.

A folder holds what a real Qwen2.5-Omni checkpoint holds: config + weights of all three stages,
`spk_dict.pt` (the speakers the codec conditions on), a tokenizer with the family's special
tokens and a chat template that renders image and audio parts as the real template does, and
one `preprocessor_config.json` that serves both the image processor and the audio feature
extractor (as the real one does).

Shrinking the real config needs care, and each rule below is one transformers relies on:
M-RoPE sections sum to head_dim / 2; the audio and vision towers' outputs are the thinker's
width; every special id the thinker reads lies inside its vocabulary and every codec id inside
the talker's; the speaker's text-bos token is a thinker token; the DiT's codec embedding table
covers the talker's vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (PreTrainedTokenizerFast, Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration,
                          Qwen2VLImageProcessorPil, WhisperFeatureExtractor)

from tests.tiny_models import build_tokenizer

FAMILIES = ("qwen2_5_omni",)

IMAGE_PLACEHOLDER = "<|vision_bos|><|IMAGE|><|vision_eos|>"
AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
SPECIAL_TOKENS = ["<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>",
                  "<|AUDIO|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>"]
SPEAKERS = ("Chelsie", "Ethan")
# The talker's codec vocabulary: speech codes below CODEC_PAD, then its control tokens.
CODEC_VOCAB = 64
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 58, 59, 60, 62
# Whisper-style log-mel features at 16 kHz; 16 mel bins keep the audio tower tiny.
SAMPLE_RATE = 16000
MEL_BINS = 16


def _chat_template() -> str:
    """ChatML where a message's content is a string or a list of parts; an image part becomes
    the image placeholder, an audio part the audio placeholder, in the order given."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] in ('image', 'image_url') or 'image' in part %}" + IMAGE_PLACEHOLDER +
        "{% elif part['type'] in ('audio', 'input_audio') or 'audio' in part %}" + AUDIO_PLACEHOLDER +
        "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# The tokens the family's processor finds by name on the tokenizer (tokenizer.audio_token...).
NAMED_TOKENS = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
                "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}


def build_omni_tokenizer() -> PreTrainedTokenizerFast:
    base = build_tokenizer()
    base.add_tokens(SPECIAL_TOKENS, special_tokens=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token,
                                        pad_token=base.pad_token, bos_token=None, extra_special_tokens=NAMED_TOKENS)
    tokenizer.chat_template = _chat_template()
    return tokenizer


@dataclass(frozen=True)
class OmniSizes:
    """A thinker and its towers; the defaults are the tiny test model (a forward in
    milliseconds). The talker stays tiny unless sized; the codec stays tiny unless
    `codec_width` is set."""

    width: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vision_width: int = 32
    vision_depth: int = 2
    vision_heads: int = 2
    audio_width: int = 32
    audio_layers: int = 2
    audio_heads: int = 2
    mel_bins: int = MEL_BINS
    # The tower attends within windows of 2 * n_window mel frames (a second spans many here).
    audio_window: int = 8
    # Pixels an image may have (28x28 is one embedding): at most 16 embeddings in the tests.
    max_pixels: int = 16 * 28 * 28
    # The talker (its head_dim 16 in the tests).
    talker_width: int = 48
    talker_layers: int = 2
    talker_heads: int = 3
    # The codec: None is the tiny one; a DiT width builds Qwen2.5-Omni-7B's code2wav (blocks of
    # 24 mel frames, 2 a code; BigVGAN's kernels and strides, 240 samples a frame) with every
    # channel count scaled by codec_width / 1024 and `codec_layers` DiT layers (22 in the 7B).
    codec_width: int | None = None
    codec_layers: int = 22


def _mrope_section(head_dim: int) -> list[int]:
    """Time, height and width sections summing to head_dim / 2 (Qwen's 16/24/24 for 128)."""
    half = head_dim // 2
    time = half // 4
    return [time, (half - time) // 2, half - time - (half - time) // 2]


def _qwen2_5_omni_config(tokenizer: PreTrainedTokenizerFast, sizes: OmniSizes) -> Qwen2_5OmniConfig:
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)))
    width = sizes.width
    text = dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=sizes.intermediate,
                num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads,
                max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": _mrope_section(width // sizes.heads)},
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                # Wider than the default 0.02 so logits are decisive and greedy choices are not ties.
                initializer_range=0.2, tie_word_embeddings=False)
    vision = dict(depth=sizes.vision_depth, hidden_size=sizes.vision_width, intermediate_size=2 * sizes.vision_width,
                  num_heads=sizes.vision_heads, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  window_size=56, fullatt_block_indexes=[sizes.vision_depth - 1], out_hidden_size=width,
                  initializer_range=0.2)
    audio = dict(num_mel_bins=sizes.mel_bins, encoder_layers=sizes.audio_layers,
                 encoder_attention_heads=sizes.audio_heads, encoder_ffn_dim=2 * sizes.audio_width,
                 d_model=sizes.audio_width, output_dim=width, n_window=sizes.audio_window, max_source_positions=1500,
                 initializer_range=0.2)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio,
                   audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
                   video_token_index=ids["<|VIDEO|>"], vision_start_token_id=ids["<|vision_bos|>"],
                   vision_end_token_id=ids["<|vision_eos|>"], audio_start_token_id=ids["<|audio_bos|>"],
                   audio_end_token_id=ids["<|audio_eos|>"],
                   user_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"), initializer_range=0.2)
    talker_head_dim = sizes.talker_width // sizes.talker_heads
    talker = dict(vocab_size=CODEC_VOCAB, embedding_size=width, hidden_size=sizes.talker_width,
                  intermediate_size=2 * sizes.talker_width, num_hidden_layers=sizes.talker_layers,
                  num_attention_heads=sizes.talker_heads, num_key_value_heads=1, head_dim=talker_head_dim,
                  max_position_embeddings=8192,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": _mrope_section(talker_head_dim)},
                  tts_text_start_token_id=ids["<tts_text_bos>"], tts_text_end_token_id=ids["<tts_text_eod>"],
                  tts_text_pad_token_id=ids["<tts_pad>"], tts_codec_start_token_id=CODEC_BOS,
                  tts_codec_end_token_id=CODEC_EOS, tts_codec_pad_token_id=CODEC_PAD,
                  tts_codec_mask_token_id=CODEC_MASK, audio_token_index=ids["<|AUDIO|>"],
                  image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
                  vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
                  audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
                  initializer_range=0.2)
    if sizes.codec_width is None:
        dit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ff_mult=2, emb_dim=16, head_dim=16,
                   block_size=8, look_ahead_layers=[1], look_backward_layers=[0], repeats=2,
                   num_embeds=CODEC_VOCAB + 1, mel_dim=20, enc_emb_dim=24, enc_dim=16,
                   enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_se_channels=16, dropout=0.0)
        bigvgan = dict(mel_dim=20, upsample_initial_channel=32, resblock_kernel_sizes=[3, 7],
                       resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]], upsample_rates=[5, 4, 3],
                       upsample_kernel_sizes=[10, 8, 6])
    else:
        dit, bigvgan = _codec_7b_proportions(sizes.codec_width, sizes.codec_layers)
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                             token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))


def _codec_7b_proportions(width: int, layers: int) -> tuple[dict, dict]:
    """The DiT and BigVGAN configs of Qwen2.5-Omni-7B (transformers' defaults are the 7B's) with
    channels scaled by width / 1024 and `layers` DiT layers, the look-back and look-ahead layers
    where the 7B has them (0 and 20, and 10, of 22): the same blocks a forward reaches."""
    if width % 64 or layers < 3:
        raise ValueError(f"a codec {width} wide (whole 64-wide heads) with at least 3 layers, got {width} x {layers}")

    def scaled(channels: int) -> int:
        return max(1, channels * width // 1024)

    # The second look-back layer stays apart from the first even at few layers.
    look_back = [0, min(layers - 1, max(1, round(20 * layers / 22)))]
    dit = dict(hidden_size=width, num_hidden_layers=layers, num_attention_heads=width // 64, head_dim=64,
               emb_dim=scaled(512), look_ahead_layers=[round(10 * layers / 22)], look_backward_layers=look_back,
               num_embeds=CODEC_VOCAB + 1, enc_emb_dim=scaled(192), enc_dim=scaled(128),
               enc_channels=[scaled(256)] * 4 + [scaled(768)], enc_attention_channels=scaled(64),
               enc_se_channels=scaled(64), dropout=0.0)
    return dit, dict(upsample_initial_channel=scaled(1536))


def _feature_extractor(sizes: OmniSizes) -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(feature_size=sizes.mel_bins, sampling_rate=SAMPLE_RATE, hop_length=160,
                                   chunk_length=30, n_fft=400, return_attention_mask=True)


def _image_processor(sizes: OmniSizes) -> Qwen2VLImageProcessorPil:
    # 28x28 pixels is one embedding (14-pixel patches merged 2x2).
    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=sizes.max_pixels, patch_size=14, merge_size=2,
                                    temporal_patch_size=2)


def save_tiny_omni(family: str, folder: Path, seed: int = 0, sizes: OmniSizes = OmniSizes()) -> Path:
    """Save a random `family` checkpoint (one of FAMILIES) into `folder`, tiny unless `sizes`
    says otherwise; returns `folder`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    folder = Path(folder)
    tokenizer = build_omni_tokenizer()
    torch.manual_seed(seed)
    config = _qwen2_5_omni_config(tokenizer, sizes)
    model = Qwen2_5OmniForConditionalGeneration(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # One preprocessor_config.json for both processors, as the real checkpoint ships it: the
    # image processor and the feature extractor each read their own keys from it.
    _image_processor(sizes).save_pretrained(folder)
    combined = json.loads((folder / "preprocessor_config.json").read_text())
    combined.update(_feature_extractor(sizes).to_dict())
    (folder / "preprocessor_config.json").write_text(json.dumps(combined, indent=2, sort_keys=True))
    # Each speaker: the thinker token that opens the talker's text stream, the codec's
    # conditioning vector and its reference mel spectrogram.
    dit = config.token2wav_config.dit_config
    generator = torch.Generator().manual_seed(seed + 1)
    speakers = {name: {"bos_token": tokenizer.convert_tokens_to_ids("<tts_text_bos_single>"),
                       "cond": torch.randn(1, dit.enc_emb_dim, generator=generator),
                       "ref_mel": torch.randn(1, 30, dit.mel_dim, generator=generator)}
                for name in SPEAKERS}
    torch.save(speakers, folder / "spk_dict.pt")
    return folder
