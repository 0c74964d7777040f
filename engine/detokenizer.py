"""Incremental detokenization with stop strings.

Each new token is decoded together with a few tokens before it, so tokenizers that merge
a leading space or a multi-byte character across tokens come out right; text that ends in
an incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it.
While streaming, the last len(longest stop string) - 1 characters are also held back, so a
client never sees the start of a stop string that later matches.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams

# Prompt tokens kept as left context for the first generated tokens.
PROMPT_CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.emitted = 0

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        self.tokens.append(token_id)
        new_text = self._decode_new()
        if not new_text:
            return None
        search_from = max(0, len(self.text) - self.holdback)
        self.text += new_text
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index >= 0:
                self.text = self.text[:index + len(stop) if self.include_stop else index]
                return stop
        return None

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens up to the first that completes a stop string; returns that string."""
        for token_id in token_ids:
            matched = self.add_token(token_id)
            if matched is not None:
                return matched
        return None

    def flush(self) -> None:
        """At the end, emit text still held back for an incomplete character."""
        if self.read_offset < len(self.tokens):
            self.text += self._decode(self.tokens[self.read_offset:])
            self.read_offset = len(self.tokens)

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def _decode_new(self) -> str:
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return full[len(prefix):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
