"""Cutting long audio into windows a speech recognizer takes whole (Whisper: 30 s).

A cut through a word loses it on both sides, so each window ends at the quietest 100 ms in
its last few seconds (pauses between words are quiet), not at the exact limit.
"""

from __future__ import annotations

import numpy as np

# The speech recognizer's input (Whisper): 16 kHz mono, at most 30 s per window.
RECOGNIZER_RATE = 16000
RECOGNIZER_WINDOW_S = 30.0
# Whisper's own threshold on its no-speech probability: above it a window is silence (on
# silence Whisper still writes a word, typically "you").
NO_SPEECH_THRESHOLD = 0.6

FRAME_S = 0.1
SEARCH_S = 5.0


def recognition_windows(samples: np.ndarray, rate: int, max_seconds: float) -> list[tuple[int, int]]:
    """(start, end) sample offsets covering `samples` in order, each at most `max_seconds`."""
    limit = int(max_seconds * rate)
    frame = max(1, int(FRAME_S * rate))
    windows: list[tuple[int, int]] = []
    start = 0
    while len(samples) - start > limit:
        search_from = start + max(frame, limit - int(SEARCH_S * rate))
        region = samples[search_from:start + limit]
        frames = len(region) // frame
        if frames == 0:
            end = start + limit
        else:
            energy = np.square(region[:frames * frame].astype(np.float64)).reshape(frames, frame).mean(axis=1)
            end = search_from + int(np.argmin(energy)) * frame + frame // 2
        windows.append((start, end))
        start = end
    windows.append((start, len(samples)))
    return windows
