"""Real speech for the voice tests, spoken by Debian's espeak-ng (scripts/install.sh installs it)."""

from __future__ import annotations

import functools
import io
import subprocess
import wave

import numpy as np
import soxr


@functools.lru_cache(maxsize=32)
def _spoken(text: str, rate: int, voice: str) -> np.ndarray:
    wav = subprocess.run(["espeak-ng", "-v", voice, "--stdout", "--", text], capture_output=True, check=True,
                         timeout=30).stdout
    with wave.open(io.BytesIO(wav)) as reader:
        native_rate = reader.getframerate()
        samples = np.frombuffer(reader.readframes(reader.getnframes()), dtype="<i2").astype(np.float32) / 32768
    return soxr.resample(samples, native_rate, rate).astype(np.float32)


def spoken(text: str, rate: int = 16000, voice: str = "en-us") -> np.ndarray:
    """`text` spoken, float32 mono at `rate` Hz (a fresh copy each call)."""
    return _spoken(text, rate, voice).copy()


def words(text: str) -> list[str]:
    """Lower-case words without punctuation: transcripts are compared by these."""
    return "".join(c for c in text.lower() if c.isalnum() or c.isspace()).split()


def transcript_similarity(heard: str, said: str) -> float:
    """0..1: how much of their letters two transcripts share, in order. Letters, not words:
    a recognizer may hear "France is" as "Francis", one word for two, nearly the same sounds."""
    import difflib

    return difflib.SequenceMatcher(None, "".join(words(heard)), "".join(words(said))).ratio()


@functools.lru_cache(maxsize=1)
def _piper():
    from workers.speech.piper_voice import PiperVoice

    return PiperVoice()


@functools.lru_cache(maxsize=32)
def _said_naturally(text: str, rate: int) -> np.ndarray:
    import onnxruntime

    voice = _piper()
    onnxruntime.set_seed(0)  # VITS samples noise: the same words, the same audio, every run
    return soxr.resample(voice.synthesize(text), voice.sample_rate, rate).astype(np.float32)


def said_naturally(text: str, rate: int = 24000) -> np.ndarray:
    """`text` spoken by the Piper voice. The Realtime tests speak with it: where server VAD
    cuts a turn moves with timing, and tiny.en hears espeak-ng's robotic speech right at only
    some cut offsets (63-73% of (phrase, offset) pairs measured), Piper's far more often."""
    return _said_naturally(text, rate).copy()
