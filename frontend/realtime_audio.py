"""A Realtime session's voice: its audio settings, its input audio buffer and its turns.

Input audio arrives in `input_audio_buffer.append` events (base64 in the session's input
format), is decoded, resampled to the recognizer's 16 kHz as one stream, and kept until a
commit. With `server_vad` turn detection the session's TurnDetector (Silero VAD) hears each
chunk (in a worker thread: it is a model): speech that starts sends `speech_started` (and
interrupts a playing answer when `interrupt_response`), speech that stops sends
`speech_stopped` and commits the turn. With `turn_detection: null` the client commits.

A commit sends `input_audio_buffer.committed`, adds the user's item (an `input_audio` part)
to the conversation, has the encoder process transcribe it, sends the transcription events,
and (server VAD with `create_response`) starts the answer. A commit of silence (Whisper's
no-speech probability over its threshold) or of nothing is an error event; the session
goes on.
"""

from __future__ import annotations

import base64
import binascii
import copy
import logging

import numpy as np
from msgspec import UNSET as _UNSET

from engine.audio_formats import decode_audio, encode_pcm16, sample_rate_of
from engine.audio_windows import RECOGNIZER_RATE
from frontend.edge_decoding import InvalidInput
from frontend.realtime_events import BETA_AUDIO_FORMATS, SessionSettings

logger = logging.getLogger("antiphon.realtime")

DEFAULT_TURN_DETECTION = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                          "silence_duration_ms": 500, "create_response": True, "interrupt_response": True}


def default_audio_settings() -> dict:
    return {"input": {"format": _format("audio/pcm"), "turn_detection": dict(DEFAULT_TURN_DETECTION),
                      "transcription": {"model": "whisper-tiny.en", "language": "en"}, "noise_reduction": None},
            "output": {"format": _format("audio/pcm"), "voice": "alloy", "speed": 1.0}}


def merged_audio_settings(current: dict, update: SessionSettings) -> dict:
    """The session's audio settings after an update in GA (`audio.input...`) or beta names."""
    settings = copy.deepcopy(current)
    given = _given(update)
    audio = _given(given.get("audio")) if "audio" in given else {}
    audio_in = _given(audio.get("input")) if "input" in audio else {}
    audio_out = _given(audio.get("output")) if "output" in audio else {}
    # Formats as their type names from here on, whichever way they came.
    for part in (audio_in, audio_out):
        if "format" in part:
            part["format"] = _format_type(part["format"])
    if "input_audio_format" in given:
        audio_in.setdefault("format", BETA_AUDIO_FORMATS[given["input_audio_format"]])
    if "output_audio_format" in given:
        audio_out.setdefault("format", BETA_AUDIO_FORMATS[given["output_audio_format"]])
    for beta, ga in (("turn_detection", "turn_detection"), ("input_audio_transcription", "transcription")):
        if beta in given:
            audio_in.setdefault(ga, given[beta])
    if "voice" in given:
        audio_out.setdefault("voice", given["voice"])
    inputs, outputs = settings["input"], settings["output"]
    if "format" in audio_in:
        inputs["format"] = _format(audio_in["format"])
    if "turn_detection" in audio_in:
        detection = audio_in["turn_detection"]
        inputs["turn_detection"] = None if detection is None else {**DEFAULT_TURN_DETECTION, **_given(detection)}
    if "transcription" in audio_in:
        transcription = audio_in["transcription"]
        inputs["transcription"] = None if transcription is None else {
            "model": "whisper-tiny.en", "language": "en", **_given(transcription)}
    if "format" in audio_out:
        outputs["format"] = _format(audio_out["format"])
    for name in ("voice", "speed"):
        if name in audio_out:
            outputs[name] = audio_out[name]
    return settings


def _given(struct) -> dict:
    if struct is None:
        return {}
    return {name: getattr(struct, name) for name in struct.__struct_fields__
            if getattr(struct, name) is not _UNSET}


def _format_type(audio_format) -> str:
    """A GA format struct's type; a rate other than the format's own is refused (this
    server resamples nothing the client sends at a rate it did not say)."""
    rate = sample_rate_of(audio_format.type)
    if audio_format.rate is not _UNSET and audio_format.rate != rate:
        raise InvalidInput(f"{audio_format.type} is {rate} Hz here, not {audio_format.rate}", "invalid_value",
                           "session.audio.format.rate")
    return audio_format.type


def _format(kind: str) -> dict:
    return {"type": kind, "rate": sample_rate_of(kind)}


def decode_client_audio(data: str, format_type: str, param: str) -> np.ndarray:
    """Base64 audio in a Realtime format -> float32 samples at the format's rate."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("audio is not valid base64", "invalid_audio", param) from None
    try:
        return decode_audio(raw, format_type)
    except ValueError as exc:
        raise InvalidInput(f"audio does not decode as {format_type}: {exc}", "invalid_audio", param) from None


def encode_client_audio(pcm16: bytes, format_type: str) -> str:
    """The talker's 16-bit PCM (already at the format's rate) as base64 in the client's format."""
    if format_type != "audio/pcm":
        pcm16 = encode_pcm16(np.frombuffer(pcm16, dtype="<i2"), format_type)
    return base64.b64encode(pcm16).decode()


_torch_threads_set = False


def new_turn_detector(threshold: float, prefix_padding_ms: int, silence_duration_ms: int):
    """A session's Silero turn detector. Imported on first use: a text-only frontend never
    loads torch. The frontend runs no other torch work, so torch gets one thread here: at its
    default two, on a busy two-core machine, a 32 ms window took 4-40 ms (slower than real
    time) against under 1.1 ms with one."""
    global _torch_threads_set
    import torch

    from workers.speech.voice_activity import TurnDetector

    if not _torch_threads_set:
        torch.set_num_threads(1)
        _torch_threads_set = True
    return TurnDetector(threshold=threshold, prefix_padding_ms=prefix_padding_ms,
                        silence_duration_ms=silence_duration_ms)


class InputAudioBuffer:
    """The audio appended since the last commit, at 16 kHz, and where it sits in the
    session's audio stream (ms since the session's first appended sample)."""

    def __init__(self, max_seconds: float) -> None:
        self.max_samples = int(max_seconds * RECOGNIZER_RATE)
        self.chunks: list[np.ndarray] = []
        self.samples = 0
        self.start_ms = 0  # stream time of the buffer's first sample
        self.stream_ms = 0.0  # stream time of the end of everything appended
        self._resampler = None
        self._rate = None

    def append(self, samples: np.ndarray, rate: int) -> np.ndarray:
        """Adds a chunk at `rate`; returns it at 16 kHz. Raises InvalidInput when full."""
        import soxr

        if rate != self._rate:  # a new format: a new resampling stream
            self._resampler = None if rate == RECOGNIZER_RATE else soxr.ResampleStream(
                rate, RECOGNIZER_RATE, 1, dtype="float32")
            self._rate = rate
        resampled = samples if self._resampler is None else self._resampler.resample_chunk(samples)
        if self.samples + len(resampled) > self.max_samples:
            raise InvalidInput(f"the input audio buffer holds at most {self.max_samples / RECOGNIZER_RATE:g} s; "
                               "commit or clear it", "input_audio_buffer_full", "audio")
        self.chunks.append(resampled)
        self.samples += len(resampled)
        self.stream_ms += 1000 * len(samples) / rate
        return resampled

    def keep_last(self, ms: float) -> None:
        """Drops all but the last `ms` of audio: with server VAD, audio before a turn's
        prefix padding is never committed, and an open microphone must not fill the buffer."""
        keep = int(ms * RECOGNIZER_RATE / 1000)
        if self.samples <= keep:
            return
        tail = np.concatenate(self.chunks)[-keep:] if keep else np.zeros(0, dtype=np.float32)
        self.chunks, self.samples = [tail], len(tail)
        self.start_ms = int(self.stream_ms - 1000 * len(tail) / RECOGNIZER_RATE)

    def peek(self, from_ms: float | None = None) -> np.ndarray:
        """What `take` would return, leaving the buffer as it is."""
        audio = np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.float32)
        if from_ms is not None:
            audio = audio[max(0, int((from_ms - self.start_ms) * RECOGNIZER_RATE / 1000)):]
        return audio

    def take(self, from_ms: float | None = None) -> np.ndarray:
        """Everything buffered (or from stream time `from_ms` on), emptying the buffer."""
        audio = self.peek(from_ms)
        self.clear()
        return audio

    def clear(self) -> None:
        self.chunks, self.samples = [], 0
        self.start_ms = int(self.stream_ms)

    @property
    def duration_ms(self) -> int:
        return int(1000 * self.samples / RECOGNIZER_RATE)
