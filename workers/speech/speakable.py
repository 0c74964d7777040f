"""What in a text can be spoken, and the text handed to espeak-ng for it.

Two rules, kept here so every path that speaks applies the same ones: the voice
(workers/speech/piper_voice.py, behind /v1/audio/speech, spoken chat answers and Realtime
voice answers) and the speech endpoint's validation (frontend/openai_audio.py), which refuses
a text with nothing to say before any work starts.

`has_words`: a text is spoken only where it has a letter or a digit. Emoji, punctuation and
whitespace make no phonemes, so a text without either is silence.

`espeak_line`: one clause as espeak-ng can read it without crashing. espeak-ng 1.51 (Debian's)
looks a run of dotted single characters up as one abbreviation ("U.S.A.", "e.g."): it copies
each character with a dot, then the word after the run, into a 160-byte stack buffer with no
bound check, and dies ("stack smashing detected") past it: at 85 letters of "a." * 85, at one
dotted letter before a 167-letter word ("e.g. " + "b" * 165), at 57 two-byte letters. The run
goes on through spaces after a dot ("a.a. a.a."), and through punctuation, combining marks and
soft hyphens, which espeak-ng drops inside a word ("a.'b.", "a.:b.", "x.y.bb?bb?bb?").

So the text is cut where espeak-ng cannot join across: at a space with no full stop beside it
(marks around the stop ignored: "a. b", "a .b" and "a , b" join, "a b" does not). What lies
between two such cuts is all espeak-ng can ever copy into that buffer at once. Where one such
stretch is over `MAX_JOINED_BYTES` and holds a dotted single character, it loses its full stops:
its letters are then read one by one, as words, and no abbreviation lookup starts. Everyday
text stays as it is: its stretches are words and short abbreviations ("J. R. R. Tolkien",
"e.g. this", "U.S.A."); a long URL has no dotted single character.

espeak-ng's command line also reads "[[...]]" as its own phoneme codes, not as text, so a
client could hand it phonemes directly; "[[" is split to "[ [", which it reads as text.
"""

from __future__ import annotations

import re

# Bytes of one stretch (see above) that reach espeak-ng with their dotted single characters
# kept. espeak-ng's buffer holds 160; the margin covers its own rewriting of a character to
# more bytes than it came in.
MAX_JOINED_BYTES = 100

# Markdown marks in an LLM's answer that espeak-ng would read aloud ("asterisk"), control
# characters (espeak-ng stops reading a line at a NUL), "_", which espeak-ng also strings into
# dotted runs ("_._._."), and lone surrogates (JSON may carry them; UTF-8 has no bytes for them).
_UNSPOKEN = str.maketrans({**{chr(code): " " for code in (*range(32), 127, *range(0xD800, 0xE000))},
                           "*": " ", "`": " ", "#": " ", "_": " "})
# Characters that are neither a letter or digit, nor a space, nor a full stop: espeak-ng may
# drop them inside a word, so they join what is around them.
_EDGE_MARKS = re.compile(r"^[^\w\s.]+|[^\w\s.]+$")
# The opening of espeak-ng's phoneme input ("[[h@'loU]]").
_PHONEME_INPUT = re.compile(r"\[(?=\[)")
# A character not after a letter or digit, then marks or spaces, then a full stop: where an
# abbreviation lookup can start ("a." "é ." "(b." "x'."). A digit counts too.
_DOTTED_SINGLE = re.compile(r"(?<![^\W_])[^\s.][^\w.]*\.")


def has_words(text: str) -> bool:
    """Whether `text` has anything the voice speaks: a letter or a digit."""
    return any(char.isalnum() for char in text)


def espeak_line(clause: str) -> str:
    """One line of text for espeak-ng: markdown marks and control characters out, whitespace
    runs to one space, no phoneme input, and no stretch espeak-ng may read as one abbreviation
    too long for it."""
    words = _PHONEME_INPUT.sub("[ ", clause.translate(_UNSPOKEN)).split()
    return " ".join(_bounded(" ".join(stretch)) for stretch in _stretches(words))


def _stretches(words: list[str]) -> list[list[str]]:
    """`words` in runs that espeak-ng may join: a word joins the one before it when a full
    stop lies between them (marks beside it ignored); a word of marks only joins both sides."""
    stretches: list[list[str]] = []
    joins_next = False
    for word in words:
        core = _EDGE_MARKS.sub("", word)
        if stretches and (joins_next or not core or core.startswith(".")):
            stretches[-1].append(word)
        else:
            stretches.append([word])
        joins_next = not core or core.endswith(".")
    return stretches


def _bounded(stretch: str) -> str:
    if len(stretch.encode("utf-8")) <= MAX_JOINED_BYTES or not _DOTTED_SINGLE.search(stretch):
        return stretch
    return " ".join(stretch.replace(".", " ").split())
