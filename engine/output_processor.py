"""Output processing for one request: new token ids in, new text out, ended by stop strings.

The offline engine and the frontend both feed each step's tokens to a
RequestOutputProcessor and emit what it returns.

Detokenization is incremental through the Rust tokenizer's DecodeStream, which keeps a
short window of ids and returns text only once it forms whole characters: a multi-byte
character split over several tokens comes out once, complete. While the request runs, the
last len(longest stop string) - 1 characters are held back, so a client never sees the
start of a stop string that later matches. When several stop strings complete, the one
that starts earliest in the text wins, whatever their order in the list.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams

# Prompt tokens the stream starts from, so the first output token decodes in context
# (a tokenizer that drops the leading space of a text's first word keeps it here).
PROMPT_CONTEXT_TOKENS = 6


@dataclass
class OutputUpdate:
    # New text to emit now.
    text: str
    # The tokens this update consumed: all of them, or up to and including the one that
    # completed a stop string (later ones were generated past the end and are dropped).
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    # A stop string ended the request here: the engine still runs it, so the caller aborts it.
    stopped_by_string: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutputProcessor:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        backend = getattr(tokenizer, "_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise ValueError(f"incremental detokenization needs a fast tokenizer (tokenizer.json), "
                             f"got {type(tokenizer).__name__}")
        self._tokenizer = backend
        self._skip_special_tokens = params.skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]),
                                    skip_special_tokens=params.skip_special_tokens)
        # Tokens given to the stream that have not produced text yet (a partial character).
        self._undecoded: list[int] = []
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        # Decoded text not emitted yet (cut at a matched stop string). While running it holds
        # at least the last `holdback` characters, which is all a stop string can start in,
        # so the whole output is never kept or copied per token.
        self._pending = ""
        self.finished = False

    def update(self, new_token_ids: list[int], finish_reason: str | None = None,
               stop_reason: int | str | None = None) -> OutputUpdate:
        """Take one step's tokens and the engine's verdict on them; a matched stop string
        overrides that verdict with finish_reason "stop" and the string as stop_reason."""
        if self.finished:
            raise RuntimeError("the request already finished")
        consumed, matched = len(new_token_ids), None
        for index, token_id in enumerate(new_token_ids):
            piece = self._stream.step(self._tokenizer, token_id)
            if piece is None:
                self._undecoded.append(token_id)
                continue
            self._undecoded.clear()
            matched = self._append(piece)
            if matched is not None:
                consumed = index + 1
                break
        if matched is None and finish_reason is not None and self._undecoded:
            # The request ends inside a character: emit what a full decode shows for it.
            matched = self._append(self._tokenizer.decode(self._undecoded, self._skip_special_tokens))
        if matched is not None:
            finish_reason, stop_reason = "stop", matched
        self.finished = finish_reason is not None
        end = len(self._pending) if self.finished else max(0, len(self._pending) - self._holdback)
        text, self._pending = self._pending[:end], self._pending[end:]
        return OutputUpdate(text, list(new_token_ids[:consumed]), finish_reason, stop_reason, matched is not None)

    def _append(self, piece: str) -> str | None:
        """Add decoded text; on a stop string, cut the text there and return the string."""
        old_length = len(self._pending)
        self._pending += piece
        best_index, best = -1, None
        for stop in self._stop:
            # Only matches that end in the new piece: earlier ones were found before.
            index = self._pending.find(stop, max(0, old_length - len(stop) + 1))
            if index >= 0 and (best is None or (index, len(stop)) < (best_index, len(best))):
                best_index, best = index, stop
        if best is not None:
            self._pending = self._pending[:best_index + len(best) if self._include_stop else best_index]
        return best
