"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    # 0 means greedy (argmax); the other sampling knobs are then ignored.
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables top-k.
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Number of top log-probabilities returned per generated token (None: none).
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _check(_is_number(getattr(self, name)), name, getattr(self, name), "must be a number")
        for name in ("top_k", "max_tokens"):
            _check(_is_int(getattr(self, name)), name, getattr(self, name), "must be an integer")
        for name in ("seed", "logprobs"):
            value = getattr(self, name)
            _check(value is None or _is_int(value), name, value, "must be an integer or None")
        _check(isinstance(self.stop, list), "stop", self.stop, "must be a string or a list of strings")
        _check(isinstance(self.stop_token_ids, list), "stop_token_ids", self.stop_token_ids,
               "must be a list of token ids")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 disables it)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
               "must be between 0 and 20")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {field}={value!r}: {rule}")
