"""A clip of any length recognized through the encoder process: in windows of at most 30 s
cut at pauses (engine/audio_windows.py), one after another; a window Whisper takes for
silence contributes no text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np

from engine.audio_windows import NO_SPEECH_THRESHOLD, RECOGNIZER_RATE, RECOGNIZER_WINDOW_S, recognition_windows
from frontend.engine_errors import EngineUnavailable, VoiceBusy
from frontend.tenancy import ANONYMOUS, Requester


async def recognized_segments(client, samples16k: np.ndarray,
                              requester: Requester = ANONYMOUS) -> AsyncIterator[dict]:
    """One verbose_json-style segment per window: id, start, end (s), text, no_speech_prob."""
    windows = recognition_windows(samples16k, RECOGNIZER_RATE, RECOGNIZER_WINDOW_S)
    for index, (start, end) in enumerate(windows):
        transcript = await client.transcribe(samples16k[start:end], requester)
        if transcript.busy:
            raise VoiceBusy(f"speech recognition is busy: {transcript.error}")
        if transcript.error is not None:
            raise EngineUnavailable(f"speech recognition failed: {transcript.error}")
        # `not <=`: a NaN probability counts as silence.
        silent = not transcript.no_speech_probability <= NO_SPEECH_THRESHOLD
        yield {"id": index, "start": round(start / RECOGNIZER_RATE, 3), "end": round(end / RECOGNIZER_RATE, 3),
               "text": "" if silent else transcript.text,
               "no_speech_prob": round(float(np.nan_to_num(transcript.no_speech_probability, nan=1.0)), 4)}


async def transcribe(client, samples16k: np.ndarray, requester: Requester = ANONYMOUS) -> tuple[str, bool]:
    """(the whole transcript, whether any speech was heard)."""
    texts = [segment["text"] async for segment in recognized_segments(client, samples16k, requester)
             if segment["text"]]
    return " ".join(texts), bool(texts)
