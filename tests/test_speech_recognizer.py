"""Speech recognition with the packaged Whisper tiny.en, converted once and run by transformers."""

from __future__ import annotations

import numpy as np
import pytest

from tests.spoken import spoken, words
from workers.speech import recognizer as recognizer_module
from workers.speech.recognizer import NO_SPEECH_THRESHOLD, SpeechRecognizer


@pytest.fixture(scope="module")
def recognizer() -> SpeechRecognizer:
    return SpeechRecognizer()


@pytest.mark.parametrize("question", ["What is the capital of France?",
                                      "Tell me a short story about a brave little mouse who lived in a big old house."])
def test_a_spoken_question_is_transcribed_word_for_word(recognizer, question):
    transcript = recognizer.transcribe(spoken(question))
    assert words(transcript.text) == words(question)
    assert transcript.no_speech_probability < NO_SPEECH_THRESHOLD


def test_the_short_window_transcribes_as_the_full_thirty_seconds(recognizer, monkeypatch):
    clips = [spoken(t) for t in ("Hello.", "What is the weather like today?")]
    short = [recognizer.transcribe(clip) for clip in clips]
    monkeypatch.setattr(recognizer_module, "MIN_WINDOW_S", 30)
    full = [recognizer.transcribe(clip) for clip in clips]
    # The same words (punctuation may differ: the window changes the decoder's inputs).
    assert [words(t.text) for t in short] == [words(t.text) for t in full]
    assert words(short[1].text) == words("What is the weather like today?")
    # The point of the short window: encoding a 0.7 s clip costs far less than 30 s would.
    assert short[0].encode_seconds < full[0].encode_seconds


def test_silence_and_noise_are_flagged_as_no_speech(recognizer):
    silence = recognizer.transcribe(np.zeros(16000, dtype=np.float32))
    noise = recognizer.transcribe(np.random.default_rng(0).normal(0, 0.01, 32000).astype(np.float32))
    empty = recognizer.transcribe(np.zeros(0, dtype=np.float32))
    for transcript in (silence, noise, empty):
        assert transcript.no_speech_probability > NO_SPEECH_THRESHOLD


def test_a_clip_longer_than_the_window_is_refused(recognizer):
    with pytest.raises(ValueError, match="at most 30 s"):
        recognizer.transcribe(np.zeros(31 * 16000, dtype=np.float32))


def test_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        SpeechRecognizer(tmp_path)
