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
