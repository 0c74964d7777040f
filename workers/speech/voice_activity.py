"""Turn detection for a Realtime session: Silero VAD under OpenAI's `server_vad` rules.

Silero VAD hears 16 kHz audio 512 samples (32 ms) at a time and answers how likely that
window holds speech. Each call also takes the 64 samples before the window (its context)
and an LSTM state that carries from window to window. The packaged TorchScript module
(`silero_vad.jit`) keeps context and state in its own attributes, so one instance cannot
serve two sessions: windows from two streams would mix. Its inner network (`_model`) takes
the state as an argument and returns the next one; that network is loaded once per process
and shared, and each TurnDetector keeps its own context and state (a few hundred floats).
The file is found without importing the `silero_vad` package, whose import loads its audio
utilities.

server_vad on the probabilities (`ServerVadRule`):
- speech starts at the first window at or over `threshold`; `speech_started` names that
  window's start less `prefix_padding_ms` (the audio kept before the speech), at least 0;
- once speaking, silence begins at a window under `threshold - 0.15` (Silero's advice: a
  lower bar to leave speech than to enter it, so the dips inside words and between them
  do not count), and only a window back at or over `threshold` cancels it;
- speech stops when the silence has lasted `silence_duration_ms`; `speech_stopped` names
  where the silence began. OpenAI's reference says its `audio_end_ms` "includes" the silence
  duration; the start of the silence is where the speech ended, which is what is given here.
Times are in the detector's own stream (ms since its first sample, or since `reset`), and
move in whole windows: an event is at most 32 ms later than a sample-exact rule would be.
"""

from __future__ import annotations

import importlib.util
import math
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SAMPLE_RATE = 16000
WINDOW_SAMPLES = 512
WINDOW_MS = 1000 * WINDOW_SAMPLES // SAMPLE_RATE  # 32
CONTEXT_SAMPLES = 64
# The bar to leave speech is this much under the bar to enter it (Silero's own choice),
# but never so low that nothing could ever count as silence.
HYSTERESIS = 0.15
MIN_NEGATIVE_THRESHOLD = 0.01


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int


VadEvent = SpeechStarted | SpeechStopped


# ---- the model ---------------------------------------------------------------------------------

_network: torch.jit.ScriptModule | None = None
_network_lock = threading.Lock()


def silero_model_path() -> Path:
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the silero-vad package is not installed (pip install silero-vad==6.2.3)")
    return Path(spec.submodule_search_locations[0]) / "data" / "silero_vad.jit"


def silero_network() -> torch.jit.ScriptModule:
    """Silero's 16 kHz network, stateless (state in, state out), loaded once per process.
    Safe to call from several threads at once: it holds no state of its own."""
    global _network
    with _network_lock:
        if _network is None:
            with warnings.catch_warnings():
                # torch points TorchScript users at torch.export; Silero ships TorchScript.
                warnings.simplefilter("ignore", DeprecationWarning)
                packaged = torch.jit.load(str(silero_model_path()), map_location="cpu").eval()
            network = getattr(packaged, "_model", None)
            # The layout of the packaged file is what this module relies on; a different
            # release may move it, which should fail here and not as wrong probabilities.
            if network is None or getattr(network, "context_size_samples", None) != CONTEXT_SAMPLES:
                raise RuntimeError(f"{silero_model_path()} is not the Silero VAD layout this server knows "
                                   "(silero-vad 6.2.3: a 16 kHz `_model` with 64 context samples)")
            _warm_up(network)
            _network = network
        return _network


def _warm_up(network: torch.jit.ScriptModule) -> None:
    """TorchScript profiles a module's first runs and optimizes it after them (65 ms here):
    paid at load, not by the first session's first chunk."""
    state = torch.zeros(0)
    with torch.inference_mode():
        for _ in range(3):
            _, state = network(torch.zeros(1, CONTEXT_SAMPLES + WINDOW_SAMPLES), state)


# ---- the rule ------------------------------------------------------------------------------------

def _check_ms(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number of milliseconds, 0 or more; got {value!r}")
    return value


class ServerVadRule:
    """OpenAI's server_vad turn rule over speech probabilities, one per 32 ms window."""

    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a number from 0.0 to 1.0; got {threshold!r}")
        self.threshold = float(threshold)
        self.negative_threshold = max(self.threshold - HYSTERESIS, MIN_NEGATIVE_THRESHOLD)
        self.prefix_padding_ms = _check_ms("prefix_padding_ms", prefix_padding_ms)
        self.silence_duration_ms = _check_ms("silence_duration_ms", silence_duration_ms)
        self.windows = 0  # windows heard
        self.speaking = False
        self.silence_from_ms: int | None = None  # where the current silence inside speech began

    def hear(self, probability: float) -> VadEvent | None:
        """The next window's probability; the event it causes, if any."""
        start_ms = self.windows * WINDOW_MS
        self.windows += 1
        if not self.speaking:
            if probability < self.threshold:
                return None
            self.speaking, self.silence_from_ms = True, None
            return SpeechStarted(int(max(0, start_ms - self.prefix_padding_ms)))
        if probability >= self.threshold:
            self.silence_from_ms = None
        elif probability < self.negative_threshold and self.silence_from_ms is None:
            self.silence_from_ms = start_ms
        if self.silence_from_ms is not None and start_ms + WINDOW_MS - self.silence_from_ms >= self.silence_duration_ms:
            self.speaking = False
            return SpeechStopped(self.silence_from_ms)
        return None


# ---- the detector ------------------------------------------------------------------------------

class TurnDetector:
    """One session's turn detection: 16 kHz float audio in chunks of any size -> events.
    One caller at a time (a session feeds its chunks in order); detectors of different
    sessions may run at once in different threads."""

    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500) -> None:
        self._settings = (threshold, prefix_padding_ms, silence_duration_ms)
        self._rule = ServerVadRule(*self._settings)  # validates before the model loads
        self._network = silero_network()
        self.reset()

    def reset(self) -> None:
        """Start over, as if new: no speech, the model's memory cleared, partial window
        dropped, the clock back at 0."""
        self._rule = ServerVadRule(*self._settings)
        self._pending = np.zeros(0, dtype=np.float32)  # the start of the next window
        self._context = torch.zeros(1, CONTEXT_SAMPLES)
        # An empty state is how the network is told to start from its initial one.
        self._state = torch.zeros(0)
        self._fed = 0

    @property
    def position_ms(self) -> float:
        """Audio fed since the start (or the last reset), in ms."""
        return 1000 * self._fed / SAMPLE_RATE

    @property
    def speaking(self) -> bool:
        return self._rule.speaking

    @property
    def silence_from_ms(self) -> int | None:
        """Where the pause that may end the current turn began (None: speech goes on, or no
        turn): a caller can start work on the turn before the pause is long enough to end it."""
        return self._rule.silence_from_ms if self._rule.speaking else None

    def feed(self, samples16k: np.ndarray) -> list[VadEvent]:
        """Hears the next chunk (float mono at 16 kHz); returns the events of the whole
        windows it completes. What is left over waits for the next chunk, so the events do
        not depend on how the stream is cut."""
        samples = np.asarray(samples16k, dtype=np.float32)
        if samples.ndim != 1:
            raise ValueError(f"audio must be mono, one sample per entry; got an array of shape {samples.shape}")
        if not np.isfinite(samples).all():
            # A NaN would stay in the model's state for good: every later window would read NaN.
            samples = np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0)
        self._fed += len(samples)
        buffered = np.concatenate([self._pending, samples]) if len(self._pending) else samples
        whole = len(buffered) - len(buffered) % WINDOW_SAMPLES
        self._pending = buffered[whole:].copy()
        if whole == 0:
            return []
        events = []
        for probability in self._probabilities(buffered[:whole]):
            event = self._rule.hear(probability)
            if event is not None:
                events.append(event)
        return events

    def _probabilities(self, samples: np.ndarray) -> list[float]:
        # A copy: the caller's array may be read-only (torch warns) or change after the call.
        windows = torch.tensor(samples).view(-1, WINDOW_SAMPLES)
        probabilities = []
        with torch.inference_mode():
            # One window at a time: each needs the state the one before left.
            for window in windows:
                heard = torch.cat([self._context, window.unsqueeze(0)], dim=1)
                probability, self._state = self._network(heard, self._state)
                self._context = heard[:, -CONTEXT_SAMPLES:]
                probabilities.append(probability.item())
        return probabilities
