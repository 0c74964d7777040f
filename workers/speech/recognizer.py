"""Speech recognition with a Whisper checkpoint run by transformers, fast on short clips.

Whisper was trained on 30-second windows and transformers' encoder insists on exactly that
many frames, so a 2-second question would pay for encoding 28 seconds of padding (most of
the time on a CPU). As whisper.cpp does with its `audio_ctx`, the encoder here sees only the
clip plus a little padding: the same encoder layers, run over the first positions of its
position table. Window sizes come in whole seconds, so a few encoder views serve every clip.
Decoding is greedy with the key/value cache, without timestamps, with Whisper's suppressed
tokens masked.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.audio_windows import NO_SPEECH_THRESHOLD, RECOGNIZER_RATE  # noqa: F401  (re-exported)
from workers.speech.whisper_checkpoint import (END_OF_TEXT_TOKEN, NO_CAPTIONS_TOKEN, NO_TIMESTAMPS_TOKEN,
                                               START_OF_TRANSCRIPT_TOKEN, ensure_default_asr_model)

SAMPLE_RATE = RECOGNIZER_RATE
# Encoder positions per second of audio (100 mel frames, halved by the second convolution).
POSITIONS_PER_SECOND = 50
# Silence after the speech inside the window: too tight a window makes Whisper drop or
# invent the last word.
TAIL_PADDING_S = 1.0
# Below ~8 s of window, tiny.en loops on short clips ("Hello? Hello? Hello?..." for a 0.7 s
# "Hello", measured with espeak-ng speech at 3 and 5 s); 8 s costs 0.1 s of encoding on two
# cores against 0.6 s for the full 30 s, with the same transcripts.
MIN_WINDOW_S = 8
# Speech carries at most ~4 words a second; a transcript far longer than its audio is a
# decoding loop, cut short.
MAX_TOKENS_PER_SECOND = 8
MIN_TOKEN_ALLOWANCE = 16


def window_seconds(seconds: float, max_window_s: int) -> int:
    """The window the encoder runs over for a clip of `seconds` (its cost: a one-second clip
    takes as long as an eight-second one)."""
    return min(max_window_s, max(MIN_WINDOW_S, math.ceil(seconds + TAIL_PADDING_S)))


@dataclass
class Transcript:
    text: str
    token_ids: list[int]
    # Whisper's estimate that the clip holds no speech: on silence it still writes something
    # ("you"), so callers drop transcripts above NO_SPEECH_THRESHOLD.
    no_speech_probability: float
    audio_seconds: float
    encode_seconds: float
    decode_seconds: float


class SpeechRecognizer:
    def __init__(self, model_path: str | Path | None = None, *, max_new_tokens: int = 200) -> None:
        from tokenizers import Tokenizer
        from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

        path = Path(model_path) if model_path is not None else ensure_default_asr_model()
        if not (path / "config.json").is_file():
            raise ValueError(f"speech model {str(path)!r} is not a local Hugging Face Whisper folder (no config.json)")
        self.model = WhisperForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.features = WhisperFeatureExtractor.from_pretrained(path)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = self.model.config
        self.max_window_s = config.max_source_positions // POSITIONS_PER_SECOND
        self.max_new_tokens = min(max_new_tokens, config.max_target_positions - 2)
        self.prompt = [config.decoder_start_token_id, NO_TIMESTAMPS_TOKEN]
        # Suppressed at every step: the checkpoint's list, and every token past the text ones
        # (the timestamps: this recognizer asks for none).
        suppress = torch.zeros(config.vocab_size, dtype=torch.bool)
        suppress[list(config.suppress_tokens or [])] = True
        suppress[NO_TIMESTAMPS_TOKEN:] = True
        suppress[START_OF_TRANSCRIPT_TOKEN:NO_TIMESTAMPS_TOKEN] = True
        self.suppress = suppress
        self.suppress_first = suppress.clone()
        self.suppress_first[list(config.begin_suppress_tokens or [])] = True
        self._encoders: dict[int, torch.nn.Module] = {}
        self._lock = threading.Lock()

    @property
    def max_seconds(self) -> float:
        return float(self.max_window_s)

    def window_seconds(self, seconds: float) -> int:
        return window_seconds(seconds, self.max_window_s)

    def transcribe(self, audio: np.ndarray) -> Transcript:
        """`audio`: float32 mono at 16 kHz, at most `max_seconds` long."""
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        seconds = len(audio) / SAMPLE_RATE
        if seconds > self.max_window_s:
            raise ValueError(f"audio of {seconds:.1f} s: this recognizer takes at most {self.max_window_s} s per clip")
        window_s = self.window_seconds(seconds)
        started = time.perf_counter()
        features = self.features(audio, sampling_rate=SAMPLE_RATE, padding="max_length",
                                 max_length=window_s * SAMPLE_RATE, return_tensors="pt").input_features
        with torch.inference_mode():
            states = self._encoder(window_s * POSITIONS_PER_SECOND)(features).last_hidden_state
            encoded = time.perf_counter()
            limit = min(self.max_new_tokens, MIN_TOKEN_ALLOWANCE + math.ceil(seconds * MAX_TOKENS_PER_SECOND))
            token_ids, no_speech = self._greedy_decode(states, limit)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True).strip()
        return Transcript(text=text, token_ids=token_ids, no_speech_probability=no_speech, audio_seconds=seconds,
                          encode_seconds=encoded - started, decode_seconds=time.perf_counter() - encoded)

    def _encoder(self, positions: int) -> torch.nn.Module:
        """The model's encoder over its first `positions` positions: a shallow copy sharing
        every layer, with a shorter position table and a config saying so."""
        full = self.model.model.encoder
        if positions == full.config.max_source_positions:
            return full
        with self._lock:
            view = self._encoders.get(positions)
            if view is None:
                view = copy.copy(full)
                view._modules = dict(full._modules)
                view._modules["embed_positions"] = torch.nn.Embedding.from_pretrained(
                    full.embed_positions.weight[:positions], freeze=True)
                view.config = copy.copy(full.config)
                view.config.max_source_positions = positions
                self._encoders[positions] = view
        return view

    def _greedy_decode(self, encoder_states: torch.Tensor, limit: int) -> tuple[list[int], float]:
        ids = torch.tensor([self.prompt])
        cache = None
        produced: list[int] = []
        no_speech = 0.0
        for step in range(limit):
            out = self.model(encoder_outputs=(encoder_states,), decoder_input_ids=ids,
                             past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            if step == 0:
                # Whisper's own silence detector: the probability of <|nocaptions|> right
                # after <|startoftranscript|>.
                no_speech = float(out.logits[0, 0].softmax(-1)[NO_CAPTIONS_TOKEN])
            logits = out.logits[0, -1].masked_fill(self.suppress_first if step == 0 else self.suppress, -math.inf)
            token = int(logits.argmax())
            if token == END_OF_TEXT_TOKEN:
                break
            produced.append(token)
            ids = torch.tensor([[token]])
        return produced, no_speech
