"""Tiny random-weight Qwen3-Omni checkpoints (thinker -> talker -> code2wav), saved as Hugging Face folders.

A folder holds what a real Qwen3-Omni-30B-A3B checkpoint holds: config and weights of all three
stages, a tokenizer with the family's special tokens (Qwen3-Omni names them as Qwen2-VL does,
plus `<|audio_start|><|audio_pad|><|audio_end|>`) and a chat template that renders image and
audio parts as the real template does, and one `preprocessor_config.json` serving both the
image processor and the Whisper feature extractor.

Shrinking the real config needs care, and each rule below is one transformers 5.23 relies on:
- M-RoPE sections sum to head_dim / 2 (the thinker interleaves them: t, h, w, t, h, w...);
- the audio and vision towers' outputs are the thinker's width;
- the audio tower cuts its input into chunks of 2 * n_window mel frames and counts 13
  embeddings per whole chunk (its output-length formula hard-codes 100-frame chunks), so
  n_window stays 50; n_window_infer (its attention window, in frames) is a multiple of 100;
- every special id the thinker reads lies inside its vocabulary and every codec id inside the
  talker's; the talker's vocabulary exceeds 1024 (generate suppresses its top 1024 ids);
- num_code_groups agrees across talker, code predictor and code2wav (num_quantizers), and
  the code predictor's vocabulary is code2wav's codebook;
- accept_hidden_layer (the thinker layer the talker reads) is below the thinker's depth;
- the talker's expert weights, which 5.23 never initializes (they are drawn here);
- three values 5.23 has no defaults for: talker_config.text_config.shared_expert_intermediate_size,
  talker_config.spatial_merge_size, thinker_config.vision_start_token_id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen3OmniMoeConfig,
                          Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor)

from tests.omni_models import _mrope_section
from tests.tiny_models import build_tokenizer

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"
SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>",
                  "<|audio_end|>", "<|audio_pad|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
# The tokens the family's processor finds by name on the tokenizer (tokenizer.audio_token...).
NAMED_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
                "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
# The talker's codec vocabulary: more than the 1024 ids generate suppresses, its control ids at the top.
TALKER_VOCAB = 1088
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = 1070, 1071, 1072, 1073, 1074, 1075
SPEAKER_CODES = {"ethan": 1080, "chelsie": 1081}
CODE_GROUPS = 4
CODEBOOK = 64
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


def build_qwen3_omni_tokenizer() -> PreTrainedTokenizerFast:
    base = build_tokenizer()
    base.add_tokens(SPECIAL_TOKENS, special_tokens=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token,
                                        pad_token=base.pad_token, bos_token=None, extra_special_tokens=NAMED_TOKENS)
    tokenizer.chat_template = _chat_template()
    return tokenizer


@dataclass(frozen=True)
class Qwen3OmniSizes:
    """A thinker (mixture of experts) and its towers; the defaults are the tiny test model
    (about a million parameters in all three stages, a forward in milliseconds)."""

    width: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    experts: int = 4
    experts_per_token: int = 2
    expert_intermediate: int = 32
    vision_width: int = 32
    vision_depth: int = 2
    vision_heads: int = 2
    # The vision layers whose outputs are added to the thinker's first layers' hidden states.
    deepstack_indexes: tuple[int, ...] = (0, 1)
    audio_width: int = 32
    audio_layers: int = 2
    audio_heads: int = 2
    mel_bins: int = MEL_BINS
    # The audio tower attends within windows of this many mel frames (2 s).
    audio_window_frames: int = 200
    # Pixels an image may have (32x32 is one embedding): at most 16 embeddings in the tests.
    max_pixels: int = 16 * 32 * 32


def _qwen3_omni_config(tokenizer: PreTrainedTokenizerFast, sizes: Qwen3OmniSizes) -> Qwen3OmniMoeConfig:
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)))
    # The role names are ordinary text (a client's "user" must tokenize as the template's); the
    # talker finds turns by their first token.
    ids.update({role: tokenizer(role)["input_ids"][0] for role in ("system", "user", "assistant")})
    width, head_dim = sizes.width, sizes.width // sizes.heads
    text = dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads,
                head_dim=head_dim, num_experts=sizes.experts, num_experts_per_tok=sizes.experts_per_token,
                moe_intermediate_size=sizes.expert_intermediate, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "interleaved": True,
                                 "mrope_section": _mrope_section(head_dim)},
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                # Wider than the default 0.02 so logits are decisive and greedy choices are not ties.
                initializer_range=0.2, tie_word_embeddings=False)
    vision = dict(depth=sizes.vision_depth, hidden_size=sizes.vision_width, intermediate_size=2 * sizes.vision_width,
                  num_heads=sizes.vision_heads, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=width, num_position_embeddings=64,
                  deepstack_visual_indexes=list(sizes.deepstack_indexes), initializer_range=0.2)
    audio = dict(num_mel_bins=sizes.mel_bins, encoder_layers=sizes.audio_layers,
                 encoder_attention_heads=sizes.audio_heads, encoder_ffn_dim=2 * sizes.audio_width,
                 d_model=sizes.audio_width, output_dim=width, n_window=50, n_window_infer=sizes.audio_window_frames,
                 downsample_hidden_size=8, max_source_positions=1500, initializer_range=0.2)
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio,
                   audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
                   video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                   audio_start_token_id=ids["<|audio_start|>"], user_token_id=ids["user"],
                   position_id_per_seconds=13, initializer_range=0.2)
    talker_head_dim = 16
    talker_text = dict(vocab_size=TALKER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=talker_head_dim, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       max_position_embeddings=8192,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "interleaved": True,
                                        "mrope_section": _mrope_section(talker_head_dim)},
                       initializer_range=0.2)
    code_predictor = dict(vocab_size=CODEBOOK, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_code_groups=CODE_GROUPS,
                          initializer_range=0.2)
    talker = dict(text_config=talker_text, code_predictor_config=code_predictor, num_code_groups=CODE_GROUPS,
                  thinker_hidden_size=width, accept_hidden_layer=sizes.layers - 1,
                  codec_eos_token_id=CODEC_EOS, codec_nothink_id=CODEC_NOTHINK, codec_think_bos_id=CODEC_THINK_BOS,
                  codec_think_eos_id=CODEC_THINK_EOS, codec_pad_id=CODEC_PAD, codec_bos_id=CODEC_BOS,
                  audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  audio_start_token_id=ids["<|audio_start|>"], position_id_per_seconds=13, spatial_merge_size=2,
                  speaker_id=dict(SPEAKER_CODES), initializer_range=0.2)
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, sliding_window=8, intermediate_size=64, num_quantizers=CODE_GROUPS,
                    upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=32)
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        im_start_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        im_end_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"], tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=ids["system"], user_token_id=ids["user"], assistant_token_id=ids["assistant"])


def _feature_extractor(sizes: Qwen3OmniSizes) -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(feature_size=sizes.mel_bins, sampling_rate=SAMPLE_RATE, hop_length=160,
                                   chunk_length=30, n_fft=400, return_attention_mask=True)


def _image_processor(sizes: Qwen3OmniSizes) -> Qwen2VLImageProcessorPil:
    # 32x32 pixels is one embedding (16-pixel patches merged 2x2).
    return Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=sizes.max_pixels, patch_size=16, merge_size=2,
                                    temporal_patch_size=2)


def save_tiny_qwen3_omni(folder: Path, seed: int = 0, sizes: Qwen3OmniSizes = Qwen3OmniSizes()) -> Path:
    """Save a random Qwen3-Omni checkpoint into `folder`, tiny unless `sizes` says otherwise;
    returns `folder`."""
    folder = Path(folder)
    tokenizer = build_qwen3_omni_tokenizer()
    torch.manual_seed(seed)
    config = _qwen3_omni_config(tokenizer, sizes)
    model = Qwen3OmniMoeForConditionalGeneration(config)
    # transformers 5.23 leaves the talker's expert weights as allocated (torch.empty): zeros or
    # garbage, whatever the memory held. Drawn here like every other weight.
    with torch.no_grad():
        for layer in model.talker.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.normal_(0.0, config.talker_config.text_config.initializer_range)
            experts.down_proj.normal_(0.0, config.talker_config.text_config.initializer_range)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # One preprocessor_config.json for both processors, as the real checkpoint ships it: the
    # image processor and the feature extractor each read their own keys from it.
    _image_processor(sizes).save_pretrained(folder)
    combined = json.loads((folder / "preprocessor_config.json").read_text())
    combined.update(_feature_extractor(sizes).to_dict())
    (folder / "preprocessor_config.json").write_text(json.dumps(combined, indent=2, sort_keys=True))
    return folder
