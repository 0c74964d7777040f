"""The text handed to espeak-ng (workers/speech/speakable.py): ordinary text as it was, long
dotted runs that crash espeak-ng 1.51 without their full stops, and the rule for a text with
nothing to say. No espeak-ng here; tests/test_piper_voice.py runs the real one."""

import re

import pytest

from workers.speech.speakable import MAX_JOINED_BYTES, espeak_line, has_words

ORDINARY = [
    "Dr. Smith lives on Baker St. near the U.S. embassy, e.g. the old one.",
    "J. R. R. Tolkien and J.R.R. Tolkien wrote it, a.k.a. the professor, Ph.D.",
    "Visit https://www.example.com/docs/getting-started.html?page=2&lang=en#install for details.",
    "e.g. https://github.com/owner/repository/blob/main/workers/speech/piper_voice.py",
    "Version v1.2.3 runs on 192.168.0.1 with piper_voice.py and config.json.",
    "It costs $3.50, i.e. about 3.14 times more than in 1999... or so.",
    "The U.S.A., the U.K. and the E.U. met at 10 a.m. in Washington D.C.",
    "**Bold** text, `code`, # heading and\tcontrol\x00characters.",
    "Pneumonoultramicroscopicsilicovolcanoconiosis. Supercalifragilisticexpialidocious.",
    "Café, naïve and Zürich keep their accents — mostly.",
]


def before_the_guard(clause: str) -> str:
    """The line espeak-ng got before the guard: markdown marks and control characters to
    spaces, whitespace runs to one space."""
    return " ".join(re.sub(r"[\x00-\x1f\x7f*`#_]", " ", clause).split())


@pytest.mark.parametrize("clause", ORDINARY)
def test_ordinary_text_reaches_espeak_as_before(clause):
    assert espeak_line(clause) == before_the_guard(clause)


@pytest.mark.parametrize("text", [
    "a." * 100,                                 # the input
    "a.a.a.a.a. " * 40,                         # runs joined across spaces after a stop
    "a . " * 100,                               # and across spaces before one
    "e.g. " + "b" * 200,                        # one abbreviation before a long word
    "www." + "x." * 90 + "com",                 # a long dotted host name
    "é." * 60 + "中." * 50,                      # each letter costs its bytes plus one
    "x.'" * 60, "a.\u00ad" * 60, "a.:" * 60,    # marks espeak-ng drops inside a word
    "y." + "bb?" * 80,                          # a long word strung through marks
])
def test_long_dotted_runs_lose_their_full_stops(text):
    line = espeak_line(text)
    assert "." not in line
    assert [c for c in line if c.isalnum()] == [c for c in text if c.isalnum()]  # no letter lost


def test_a_dotted_run_within_the_bound_keeps_its_stops():
    run = "x." * (MAX_JOINED_BYTES // 2)
    assert espeak_line(run) == run
    assert "." not in espeak_line(run + "x.")


def test_a_long_url_without_dotted_letters_keeps_its_dots():
    url = "https://www.example.com/" + "section/" * 30 + "page.html"
    assert espeak_line(url) == url


@pytest.mark.parametrize("text, speaks", [
    ("Hello", True), ("42", True), ("😀 a", True), ("é", True), ("中", True),
    ("", False), ("   \n\t", False), ("😀🎉", False), ("...!?", False), ("— * —", False),
    ("\u202e\u200f\u200b", False), ("\x00\x01", False), ("\ud800", False),
])
def test_a_text_has_words_only_with_a_letter_or_digit(text, speaks):
    assert has_words(text) is speaks


def test_espeak_phoneme_input_is_read_as_text():
    assert "[[" not in espeak_line("say [[h@'loU]] or [[[[x")
    assert espeak_line("a [1] and [2]") == "a [1] and [2]"
