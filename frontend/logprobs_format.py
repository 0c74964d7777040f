"""The engine's log-probabilities in OpenAI's two shapes.

The engine returns, per generated token, its own log-probability and the top-n (token id,
log-probability) pairs, taken from the model's logits before any grammar or bias (as
vLLM's default). Chat completions want `{"content": [{token, logprob, bytes,
top_logprobs}]}`; completions want parallel lists (tokens, token_logprobs, top_logprobs as
{token: logprob}, text_offset). A token's text is its own bytes: for a byte-level BPE
tokenizer, the bytes its symbols stand for (a piece of a multi-byte character stays
exact in `bytes`, and is shown with the replacement character in `token`).
"""

from __future__ import annotations

import math
from functools import lru_cache

from engine.byte_level import byte_level_alphabet, is_byte_level


class LogprobFormatter:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_of = byte_level_alphabet() if is_byte_level(tokenizer) else {}
        self.token_bytes = lru_cache(maxsize=1 << 16)(self._token_bytes)
        # Special tokens (an EOS, a chat marker) are not part of the text answers show, so
        # they have no entry either: the entries' bytes add up to the answer's text.
        self.hidden_ids = frozenset(tokenizer.all_special_ids)

    def _token_bytes(self, token_id: int) -> bytes:
        symbol = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(symbol, str) and symbol and all(ch in self._byte_of for ch in symbol):
            return bytes(self._byte_of[ch] for ch in symbol)
        return self.tokenizer.decode([token_id]).encode()

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode(errors="replace")

    def chat(self, token_ids: list[int], logprobs: list) -> dict:
        """`logprobs` in a chat choice (or a streamed chunk's choice) for these tokens."""
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            if token_id in self.hidden_ids:
                continue
            item = self._entry(token_id, entry.sampled_logprob)
            item["top_logprobs"] = [self._entry(top_id, value) for top_id, value in entry.top]
            content.append(item)
        return {"content": content, "refusal": None}

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self.token_bytes(token_id)
        return {"token": raw.decode(errors="replace"), "logprob": _finite(logprob), "bytes": list(raw)}

    def completion(self, token_ids: list[int], logprobs: list, text_offset: int) -> dict:
        """`logprobs` of a completions choice; offsets count characters from `text_offset`."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, logprobs):
            if token_id in self.hidden_ids:
                continue
            text = self.token_text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(entry.sampled_logprob))
            out["top_logprobs"].append({self.token_text(t): _finite(v) for t, v in entry.top})
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out


def _finite(value: float) -> float:
    # A token the model gives zero probability has -inf; JSON has no infinity.
    return value if math.isfinite(value) else -9999.0
