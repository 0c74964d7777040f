"""Cutting a streamed LLM answer into pieces a voice can speak, as early as sense allows.

A spoken answer starts when its first piece has been synthesized, so the first piece is cut
short: at the first clause mark once a few words are in, or after a handful of words even
without one. Later pieces are whole sentences: the voice gets complete intonation units and
is called fewer times. A cap cuts a run-on sentence, so no piece waits for text without end.

A full stop ends a sentence only where it can: not inside "3.14", not after "e.g." or "Dr.",
not after a list number ("1."), and never at the very end of text still streaming ("3." may
become "3.14"). The same rules split a whole text for synthesis (`split_clauses`, used by
workers/speech/piper_voice.py), so a streamed answer and a spoken text break alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

# Words whose full stop is part of the word. Short on purpose: a miss costs one early cut
# (a pause in the voice), while "etc." and "no." end sentences too often to be listed.
ABBREVIATIONS = frozenset({
    "e.g.", "i.e.", "vs.", "cf.", "approx.", "dr.", "mr.", "mrs.", "ms.", "prof.", "st.",
    "jr.", "sr.", "mt.", "fig.", "a.m.", "p.m.", "u.s.", "u.k.", "ph.d.", "inc.", "ltd.",
})

# A run of stops (". ! ? …", closing quotes or brackets allowed after it) or of clause marks,
# counted only when whitespace or the end of the text follows, which is what keeps "3.14",
# "3,000" and "3:45" whole; an em dash always; a spaced hyphen or en dash; a line end.
_BOUNDARY = re.compile(
    r"(?P<stop>[.!?…]+)[\"'”’)\]*]*(?=\s|$)"
    r"|(?P<pause>[,;:])[\"'”’)\]*]*(?=\s|$)"
    r"|(?P<dash>—|(?<=\s)[-–]+(?=\s))"
    r"|(?P<line>\n)"
)
_LETTER = re.compile(r"[^\W\d_]")


@dataclass(frozen=True)
class Boundary:
    """Where a clause ends in a text: `end` is just past its mark. `mark` is "." "?" "!" for
    a sentence end, "\\n" for a line end, "," ";" ":" for a pause inside a sentence (dashes
    and ellipses pause like a comma)."""

    end: int
    mark: str

    @property
    def ends_sentence(self) -> bool:
        return self.mark in ".?!\n"


def _stop_mark(stops: str) -> str:
    if "?" in stops:
        return "?"
    if "!" in stops:
        return "!"
    # "..." or "…" trails off mid-thought more often than it ends one.
    return "." if stops == "." else ","


def _ends_with_abbreviation(text: str) -> bool:
    """Whether the word that ends `text` (with its full stop) is an abbreviation or an
    initial ("J."), whose stop ends no sentence."""
    word = text.rsplit(None, 1)[-1].lstrip("\"'“‘([").lower()
    return word in ABBREVIATIONS or (len(word) == 2 and word[0].isalpha())


def clause_boundaries(text: str, *, final: bool) -> Iterator[Boundary]:
    """The clause ends of `text`, in order. With `final` False the text is still streaming:
    a mark at its very end is not a boundary yet, as the next delta may continue it. A
    clause without a letter ("1." of a list, "42," of "42, 43") is never cut off alone."""
    start = 0
    for match in _BOUNDARY.finditer(text):
        if not final and match.end() == len(text) and match.lastgroup in ("stop", "pause"):
            return
        if not _LETTER.search(text, start, match.start()):
            continue
        if match.lastgroup == "stop":
            mark = _stop_mark(match["stop"])
            if mark == "." and _ends_with_abbreviation(text[start:match.start("stop") + 1]):
                continue
        else:
            mark = {"pause": match["pause"], "dash": ",", "line": "\n"}[match.lastgroup]
        yield Boundary(match.end(), mark)
        start = match.end()


def split_clauses(text: str) -> list[tuple[str, str]]:
    """A whole text as (clause, mark) pairs in order; the clause text keeps its own
    punctuation. The last clause's mark is "" when the text ends without one."""
    clauses, start = [], 0
    for boundary in clause_boundaries(text, final=True):
        clauses.append((text[start:boundary.end], boundary.mark))
        start = boundary.end
    if text[start:].strip():
        clauses.append((text[start:], ""))
    return clauses


def _end_of_words(text: str, count: int) -> int | None:
    """Index just past the `count`-th word of `text`, if that word is known to be complete
    (whitespace follows it); None while fewer complete words have arrived."""
    words = list(re.finditer(r"\S+(?=\s)", text))
    return words[count - 1].end() if len(words) >= count else None


def _last_word_end(text: str, limit: int) -> int:
    """The last word boundary at or before `limit`; `limit` itself for one endless word."""
    word_ends = [match.start() for match in re.finditer(r"(?<=\S)\s", text[:limit + 1])]
    return word_ends[-1] if word_ends else limit


class ClauseSplitter:
    """Streamed text deltas in, pieces to synthesize out, for one answer at a time.

    The first piece is cut at the first clause mark after at least `first_min_words` words,
    or after `first_max_words` complete words without one, or at a sentence end, whichever
    comes first. Later pieces end at sentence ends and line ends. No piece is longer than
    `max_chars` unless one word is: a longer sentence is cut at its last clause mark within
    the cap, else at its last word boundary. `flush` ends the answer and returns the rest;
    the splitter is then ready for the next answer.
    """

    def __init__(self, *, first_min_words: int = 3, first_max_words: int = 8, max_chars: int = 200) -> None:
        if not 1 <= first_min_words <= first_max_words:
            raise ValueError("need 1 <= first_min_words <= first_max_words, "
                             f"got {first_min_words} and {first_max_words}")
        if max_chars < 1:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.first_min_words = first_min_words
        self.first_max_words = first_max_words
        self.max_chars = max_chars
        self._pending = ""
        self._started = False

    def feed(self, delta: str) -> list[str]:
        self._pending += delta
        return self._cut(final=False)

    def flush(self) -> list[str]:
        pieces = self._cut(final=True)
        rest, self._pending, self._started = self._pending.strip(), "", False
        return pieces + [rest] if rest else pieces

    def _cut(self, *, final: bool) -> list[str]:
        pieces = []
        while (end := self._next_cut(final)) is not None:
            piece, self._pending = self._pending[:end].strip(), self._pending[end:]
            if piece:
                pieces.append(piece)
                self._started = True
        return pieces

    def _next_cut(self, final: bool) -> int | None:
        text = self._pending
        last_pause = None
        for boundary in clause_boundaries(text, final=final):
            if boundary.end > self.max_chars:
                break
            early = not self._started and len(text[:boundary.end].split()) >= self.first_min_words
            if boundary.ends_sentence or early:
                return boundary.end
            last_pause = boundary.end
        if not self._started:
            end = _end_of_words(text, self.first_max_words)
            if end is not None and end <= self.max_chars:
                return end
        if len(text) > self.max_chars:
            return last_pause or _last_word_end(text, self.max_chars)
        return None
