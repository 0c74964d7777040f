"""The fewest tokens a byte-level BPE tokenizer can make of a text, found without tokenizing it.

Such a tokenizer covers a text's bytes (after its normalizer) exactly with its tokens, so
bytes / (longest token) is a floor. It is a weak one: a few tokens are long runs of one
character ("=" * 64, a newline and 80 spaces), so it allows 81 bytes a token where prose
takes 4 to 6. The floor here also uses which bytes the long tokens hold. With
`longest_with[b]` the length of the longest token that holds byte b, a byte whose
`longest_with` is at most k is covered only by tokens of at most k bytes; a text with
`short` such bytes and `long` others takes at least short / k + long / L tokens (L the
longest token: the fewest tokens cover the `short` bytes k at a time and the rest L at a
time). The floor is the best of these over every k, from the text's byte histogram, which
costs a pass over the bytes where tokenizing costs a BPE merge loop per word.
"""

from __future__ import annotations

import re

import numpy as np

from engine.byte_level import byte_level_alphabet, is_byte_level

# transformers' sanitize_control_tokens drops these two private-use characters from client
# text (they mark the control tokens a client typed): the prompt it tokenizes lacks them.
SANITIZE_MARKERS = ("\U000f0000", "\U000f0001")
# Normalizers under which the floor holds besides none: Unicode's composition (Qwen), run
# here on the same pieces the tokenizer runs it on.
SOUND_NORMALIZERS = ("NFC",)


class TokenFloor:
    def __init__(self, longest_with: np.ndarray, normalizer=None, raw_tokens: re.Pattern | None = None) -> None:
        self.longest = int(longest_with.max())
        # Only the lengths some byte has matter: between two of them the floor falls as k grows.
        self.lengths = np.unique(np.concatenate([longest_with, [1]])).astype(np.int64)
        # held_longer[b, i]: byte b is in some token longer than lengths[i].
        self.held_longer = (longest_with[:, None] > self.lengths[None, :]).astype(np.int64)
        self.normalizer = normalizer
        self.raw_tokens = raw_tokens

    @classmethod
    def of(cls, tokenizer) -> TokenFloor | None:
        """The floor of a transformers fast tokenizer; None where it would not hold (not
        byte-level BPE, another normalizer, an added token that swallows the spaces beside it)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not is_byte_level(tokenizer) or type(backend.model).__name__ != "BPE":
            return None
        normalizer = backend.normalizer
        if normalizer is not None and type(normalizer).__name__ not in SOUND_NORMALIZERS:
            return None
        added = list(tokenizer.added_tokens_decoder.values())
        if any(token.lstrip or token.rstrip or token.single_word for token in added):
            return None
        # Symbol -> the latin-1 character of its byte; a character outside the alphabet fails to encode.
        alphabet = byte_level_alphabet()
        to_bytes = {ord(symbol): chr(byte) for symbol, byte in alphabet.items()}
        to_bytes.update({code: "\uffff" for code in range(256) if chr(code) not in alphabet})
        added_contents = {token.content for token in added}
        pieces = []
        for symbol in tokenizer.get_vocab():
            if symbol in added_contents:
                pieces.append(symbol.encode())
                continue
            try:
                pieces.append(symbol.translate(to_bytes).encode("latin-1"))
            except UnicodeEncodeError:
                return None  # a symbol outside the byte alphabet: not a vocabulary this floor knows
        pieces = [piece for piece in pieces if piece]
        lengths = np.array([len(piece) for piece in pieces], dtype=np.int64)
        longest_with = np.zeros(256, dtype=np.int64)
        np.maximum.at(longest_with, np.frombuffer(b"".join(pieces), dtype=np.uint8), np.repeat(lengths, lengths))
        # A byte that no token holds: assume the worst, that the longest token may cover it.
        longest_with[longest_with == 0] = lengths.max()
        # Added tokens matched before normalizing (the tokenizer normalizes only the text between them).
        raw = [re.escape(token.content) for token in sorted(added, key=lambda t: len(t.content), reverse=True)
               if not token.normalized and token.content]
        return cls(longest_with, normalizer, re.compile("|".join(raw)) if raw and normalizer is not None else None)

    def tokens(self, text: str) -> int:
        """At least how many tokens `text` takes (with any control tokens in it kept whole or
        sanitized into plain text)."""
        for marker in SANITIZE_MARKERS:
            if marker in text:
                text = text.replace(marker, "")
        data = np.frombuffer(self._normalized(text).encode(), dtype=np.uint8)
        if not len(data):
            return 0
        counts = np.bincount(data, minlength=256).astype(np.int64)
        long = counts @ self.held_longer  # per length k: the bytes a token longer than k may cover
        short = len(data) - long
        # ceil(short / k + long / L) for each k, in integers.
        numerators = short * self.longest + long * self.lengths
        denominators = self.lengths * self.longest
        return int((-(-numerators // denominators)).max())

    def _normalized(self, text: str) -> str:
        """What the tokens cover: the text between the raw added tokens through the normalizer,
        those tokens as they are."""
        if self.normalizer is None:
            return text
        if self.raw_tokens is None:
            return self.normalizer.normalize_str(text)
        out, start = [], 0
        for match in self.raw_tokens.finditer(text):
            out += [self.normalizer.normalize_str(text[start:match.start()]), match.group()]
            start = match.end()
        out.append(self.normalizer.normalize_str(text[start:]))
        return "".join(out)
