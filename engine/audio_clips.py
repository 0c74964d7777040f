"""An audio clip given to a model that hears (an omni model's audio items), checked before its
adapter makes features of it.

Offline, a clip is `(samples, sample_rate)`, as vLLM takes it: a 1-D array of mono samples
(floats in [-1, 1], or int16 PCM) and its rate in Hz. The server decodes its clips from the
wire formats first (engine/audio_formats.py) and hands them on in the same form.
"""

from __future__ import annotations

import numpy as np

from engine.media import MediaError, MediaLimits


def check_audio_count(n: int, limits: MediaLimits) -> None:
    if n > limits.max_audio_clips_per_request:
        raise MediaError("too_many_audio_clips", f"the request has {n} audio clips; the limit is "
                         f"max_audio_clips_per_request = {limits.max_audio_clips_per_request}")


def audio_clip(source) -> tuple[np.ndarray, int]:
    """(float32 mono samples, rate) from `(samples, rate)`; MediaError("invalid_audio") naming
    what is wrong with anything else."""
    if not isinstance(source, (tuple, list)) or len(source) != 2:
        raise MediaError("invalid_audio", "an audio clip must be a (samples, sample_rate) pair")
    samples, rate = source
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not 0 < rate <= 384_000:
        raise MediaError("invalid_audio", f"an audio clip's sample rate must be an integer in 1..384000 Hz, "
                         f"got {rate!r}")
    array = np.asarray(samples)
    if array.ndim != 1 or array.size == 0:
        raise MediaError("invalid_audio", f"an audio clip must be a non-empty 1-D array of mono samples, "
                         f"got shape {array.shape}")
    if array.dtype == np.int16:
        array = array.astype(np.float32) / 32768.0
    elif array.dtype.kind == "f":
        array = array.astype(np.float32, copy=False)
        if not np.isfinite(array).all():
            raise MediaError("invalid_audio", "an audio clip holds NaN or infinite samples")
    else:
        raise MediaError("invalid_audio", f"audio samples must be floats or int16 PCM, got {array.dtype}")
    return array, int(rate)
