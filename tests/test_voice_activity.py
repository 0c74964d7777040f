"""Turn detection (Silero VAD + server_vad rules) on real speech from espeak-ng, and the rule
itself on hand-made probabilities.

Speech clips are trimmed to their audible part (10 ms frames over 1% of the loudest frame's
RMS), so where speech begins and ends in a test signal is known to the frame.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine.audio_formats import resample
from tests.spoken import spoken
from workers.speech.voice_activity import (WINDOW_MS, WINDOW_SAMPLES, ServerVadRule, SpeechStarted, SpeechStopped,
                                           TurnDetector)

RATE = 16000
LOW_NOISE = 0.003  # RMS, about -50 dBFS: a quiet room through a decent microphone
SENTENCE = "The quick brown fox jumps over the lazy dog."
QUESTION = "What is the capital of France?"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Silero's per-window operations are tiny; split over two OpenMP threads on a 2-core
    machine that is busy with anything else, the threads wait on each other at every step
    (this file: 6 s with one thread, 160 s with two beside a running server test). What these
    tests pin does not depend on the thread count; the setting is restored after them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def speech(text: str) -> np.ndarray:
    """`text` spoken by espeak-ng (22.05 kHz) at 16 kHz, trimmed to where it is audible."""
    samples = resample(spoken(text, rate=22050), 22050, RATE)
    frame = RATE // 100
    frames = samples[:len(samples) // frame * frame].reshape(-1, frame).astype(np.float64)
    rms = np.sqrt(np.mean(frames ** 2, axis=1))
    audible = np.nonzero(rms > 0.01 * rms.max())[0]
    return samples[audible[0] * frame:(audible[-1] + 1) * frame]


def ms(milliseconds: float) -> int:
    return int(milliseconds * RATE / 1000)


def scene(*parts: np.ndarray | int, noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """Clips and silences (an int: that many ms) one after another, with white noise over all."""
    audio = np.concatenate([np.zeros(ms(part), np.float32) if isinstance(part, int) else part for part in parts])
    return (audio + np.random.default_rng(seed).normal(0, noise, len(audio))).astype(np.float32)


def events_of(detector: TurnDetector, audio: np.ndarray, chunk: int | None = None) -> list:
    if chunk is None:
        return detector.feed(audio)
    return [event for start in range(0, len(audio), chunk) for event in detector.feed(audio[start:start + chunk])]


def timed_events(detector: TurnDetector, audio: np.ndarray) -> list[tuple[object, float]]:
    """Each event with the stream position at which the detector gave it (fed window by window)."""
    return [(event, detector.position_ms) for start in range(0, len(audio), WINDOW_SAMPLES)
            for event in detector.feed(audio[start:start + WINDOW_SAMPLES])]


# ---- on real speech -------------------------------------------------------------------------

@pytest.mark.parametrize("noise", [0.0, LOW_NOISE], ids=["digital-silence", "low-noise"])
@pytest.mark.parametrize("text", [SENTENCE, QUESTION])
def test_speech_starts_once_at_its_onset_and_stops_once_after_the_silence(text, noise):
    clip = speech(text)
    onset_ms, end_ms = 1000, 1000 + 1000 * len(clip) / RATE
    detector = TurnDetector(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
    events = timed_events(detector, scene(1000, clip, 1500, noise=noise))

    assert [type(event) for event, _ in events] == [SpeechStarted, SpeechStopped], events
    (started, _), (stopped, stopped_at) = events
    # The window where Silero first says speech, less the padding. That window may hold the
    # onset itself (so start one window early); Silero is sure of speech within a few
    # windows of it (measured 1 to 3 with espeak-ng's voice): 160 ms is 5 windows.
    heard_at = started.audio_start_ms + 300
    assert onset_ms - WINDOW_MS <= heard_at <= onset_ms + 160, (onset_ms, started)
    # Silero's probability follows the end of speech with a lag of a few windows, either way:
    # a fading last consonant may already read as silence (seen: 76 ms early), and the LSTM
    # may hold on to speech a little after the last sound (seen: 120 ms late).
    assert end_ms - 160 <= stopped.audio_end_ms <= end_ms + 200, (end_ms, stopped)
    # The stop is given as soon as silence_duration_ms of silence have been heard: in whole
    # windows, so up to one window later.
    assert 500 <= stopped_at - stopped.audio_end_ms < 500 + WINDOW_MS, (stopped, stopped_at)


@pytest.mark.parametrize("noise", [0.0, LOW_NOISE, 0.01], ids=["digital-silence", "low-noise", "-40dBFS-noise"])
def test_silence_or_noise_alone_is_never_speech(noise):
    detector = TurnDetector()
    assert detector.feed(scene(8000, noise=noise)) == []
    assert not detector.speaking


def test_prefix_padding_is_clamped_at_the_start_of_the_stream():
    detector = TurnDetector(prefix_padding_ms=300)
    started = detector.feed(scene(100, speech(QUESTION), 200))[0]
    assert started == SpeechStarted(0)


def test_a_pause_shorter_than_the_silence_duration_keeps_one_turn():
    first, second = speech("Good morning."), speech("How are you today?")
    audio = scene(500, first, 300, second, 1000)  # a 300 ms pause between the two

    patient = TurnDetector(silence_duration_ms=500).feed(audio)
    assert [type(event) for event in patient] == [SpeechStarted, SpeechStopped], patient

    # The same audio with a shorter patience: the pause ends the first turn.
    eager = TurnDetector(silence_duration_ms=150).feed(audio)
    assert [type(event) for event in eager] == [SpeechStarted, SpeechStopped] * 2, eager
    first_end_ms = 500 + 1000 * len(first) / RATE
    assert first_end_ms - 160 <= eager[1].audio_end_ms <= first_end_ms + 200


def test_events_do_not_depend_on_how_the_stream_is_cut():
    audio = scene(300, speech("Good morning."), 800, noise=LOW_NOISE)  # short: 1-sample chunks are slow
    whole = events_of(TurnDetector(), audio)
    assert [type(event) for event in whole] == [SpeechStarted, SpeechStopped], whole
    for chunk in (1, 160, 480, 2400):
        assert events_of(TurnDetector(), audio, chunk) == whole, chunk


def test_position_counts_every_sample_fed_even_short_of_a_window():
    detector = TurnDetector()
    detector.feed(np.zeros(100, np.float32))
    detector.feed(np.zeros(700, np.float32))
    assert detector.position_ms == 50.0


def test_two_detectors_fed_interleaved_do_not_disturb_each_other():
    audio_a = scene(1000, speech(SENTENCE), 1000, noise=LOW_NOISE, seed=1)
    audio_b = scene(400, speech(QUESTION), 700, speech("Good morning."), 800, seed=2)
    alone_a = events_of(TurnDetector(), audio_a)
    alone_b = events_of(TurnDetector(silence_duration_ms=300), audio_b)
    assert len(alone_a) == 2 and len(alone_b) == 4, (alone_a, alone_b)

    a, b = TurnDetector(), TurnDetector(silence_duration_ms=300)
    got_a, got_b = [], []
    for start in range(0, max(len(audio_a), len(audio_b)), 480):
        got_a += a.feed(audio_a[start:start + 480])
        got_b += b.feed(audio_b[start:start + 480])
    assert (got_a, got_b) == (alone_a, alone_b)


def test_detectors_in_threads_at_once_match_each_alone():
    """The frontend runs each session's detector in a worker thread; the network is shared."""
    audios = [scene(300 * k, speech(text), 800, noise=LOW_NOISE, seed=k)
              for k, text in enumerate([SENTENCE, QUESTION, "Good morning."])]
    alone = [events_of(TurnDetector(), audio) for audio in audios]
    assert all(len(events) == 2 for events in alone), alone

    results: list[list] = [[] for _ in audios]
    start_together = threading.Barrier(len(audios))

    def run(index: int) -> None:
        detector = TurnDetector()
        start_together.wait()
        results[index] = events_of(detector, audios[index], 480)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(audios))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == alone


def test_reset_starts_over_as_a_new_detector():
    audio = scene(600, speech(QUESTION), 900)
    fresh = events_of(TurnDetector(), audio)

    detector = TurnDetector()
    # Halfway through the speech: speaking, the model's memory full of it, a partial window.
    assert detector.feed(audio[:ms(1200) + 100]) == [fresh[0]]
    assert detector.speaking
    detector.reset()
    assert detector.position_ms == 0 and not detector.speaking
    assert events_of(detector, audio) == fresh


def test_reset_clears_the_model_memory_not_only_the_rule():
    """Audio heard before a reset must not colour the probabilities after it: with the same
    audio after a reset, every window's probability matches a new detector's."""
    before, after = whole_windows(scene(300, speech(SENTENCE))), whole_windows(scene(200, speech(QUESTION), 300))
    detector, fresh = TurnDetector(), TurnDetector()
    detector.feed(before)
    detector.reset()
    assert detector._probabilities(after) == fresh._probabilities(after)
    # ... and without the reset they would differ (so the check above can fail).
    assert TurnDetector()._probabilities(np.concatenate([before, after]))[-len(after) // WINDOW_SAMPLES:] \
        != fresh._probabilities(after)


def whole_windows(audio: np.ndarray) -> np.ndarray:
    return audio[:len(audio) - len(audio) % WINDOW_SAMPLES]


def test_a_nan_in_the_audio_does_not_poison_the_detector():
    audio = scene(500, speech(QUESTION), 900)
    broken = audio.copy()
    broken[100:110] = np.nan  # in the leading silence
    assert events_of(TurnDetector(), broken) == events_of(TurnDetector(), audio)


def test_feed_refuses_more_than_one_channel():
    with pytest.raises(ValueError, match="mono"):
        TurnDetector().feed(np.zeros((2, 512), np.float32))


# ---- the rule on hand-made probabilities ----------------------------------------------------

def heard(rule: ServerVadRule, probabilities: list[float]) -> list[tuple[int, object]]:
    """(window index, event) for each event the probabilities cause."""
    return [(index, event) for index, probability in enumerate(probabilities)
            if (event := rule.hear(probability)) is not None]


def test_rule_starts_at_the_first_window_over_threshold_less_the_padding():
    assert heard(ServerVadRule(0.5, 100, 500), [0.1] * 20 + [0.5]) == [(20, SpeechStarted(20 * 32 - 100))]
    assert heard(ServerVadRule(0.5, 300, 500), [0.2, 0.49, 0.6]) == [(2, SpeechStarted(0))]


def test_rule_dips_between_the_two_thresholds_never_begin_silence():
    # 0.4 is under the threshold (0.5) but over the bar to leave speech (0.35).
    assert heard(ServerVadRule(0.5, 0, 100), [0.9] + [0.4] * 50) == [(0, SpeechStarted(0))]


def test_rule_stops_when_the_silence_has_lasted_its_duration():
    rule = ServerVadRule(0.5, 0, 500)
    # 15 windows (480 ms) of silence is not enough; speech again cancels it.
    assert heard(rule, [0.9] * 10 + [0.1] * 15 + [0.9] * 5) == [(0, SpeechStarted(0))]
    # Then silence from window 30 (960 ms): the 16th window ends 512 ms after it began.
    assert heard(rule, [0.1] * 16) == [(15, SpeechStopped(960))]
    assert not rule.speaking


def test_rule_windows_between_the_thresholds_do_not_cancel_a_silence_begun():
    rule = ServerVadRule(0.5, 0, 200)
    events = heard(rule, [0.9] + [0.2] + [0.45] * 10)
    assert events == [(0, SpeechStarted(0)), (7, SpeechStopped(32))]


def test_rule_a_new_turn_can_start_after_a_stop():
    rule = ServerVadRule(0.5, 0, 64)
    events = heard(rule, [0.8, 0.1, 0.1, 0.3, 0.7, 0.1, 0.1])
    assert events == [(0, SpeechStarted(0)), (2, SpeechStopped(32)), (4, SpeechStarted(128)),
                      (6, SpeechStopped(160))]


def test_rule_negative_threshold_follows_silero_and_stays_above_zero():
    assert ServerVadRule(0.5).negative_threshold == pytest.approx(0.35)
    assert ServerVadRule(0.1).negative_threshold == pytest.approx(0.01)


@pytest.mark.parametrize("settings", [
    {"threshold": -0.1}, {"threshold": 1.5}, {"threshold": float("nan")}, {"threshold": True},
    {"threshold": "0.5"}, {"prefix_padding_ms": -1}, {"silence_duration_ms": float("inf")},
    {"silence_duration_ms": None},
])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError):
        TurnDetector(**settings)


def test_edge_settings_are_taken():
    TurnDetector(threshold=0.0, prefix_padding_ms=0, silence_duration_ms=0)
    TurnDetector(threshold=1.0, prefix_padding_ms=2000, silence_duration_ms=5000)
