"""Per-request sampling parameters, validated on construction.

Every value that passes validation also encodes on the wire (msgpack ints are 64-bit) and
works in the sampler (torch seeds span [-2**63, 2**64)): a request the frontend accepts
must never fail later, after it was registered.
"""

from __future__ import annotations

import json
import math
import reprlib

import msgspec

# Counts and token ids far beyond any vocabulary or context, and within every int type on the way.
MAX_COUNT = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)
# Top log-probabilities any process computes per token; the frontend's --max-logprobs is lower.
MAX_LOGPROBS = 1024
# logit_bias entries per request (OpenAI allows 300; each costs a little on every step).
MAX_LOGIT_BIAS = 1024
# A stop string's length is text held back from streaming, and searched again per token.
MAX_STOP_STRING_LENGTH = 1024
# Temperatures below this sample greedily.
GREEDY_BELOW_TEMPERATURE = 1e-5
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


# Structured output kinds (engine/grammars.py compiles each) and the largest spec any
# process accepts; the frontend's --max-grammar-bytes is usually lower.
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20


class StructuredOutput(msgspec.Struct, frozen=True):
    """What the answer must match. `spec`: the JSON schema's text, the regex, a JSON list of
    choices, or an EBNF grammar (empty for json_object). Frozen: the spec is a cache key."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_KINDS, "structured_output.kind", self.kind, f"must be one of {STRUCTURED_KINDS}")
        _check(isinstance(self.spec, str) and len(self.spec) <= MAX_SPEC_CHARS, "structured_output.spec",
               self.spec, f"must be a string of at most {MAX_SPEC_CHARS} characters")
        if self.kind == "choice":
            _check(_is_choice_list(self.spec), "structured_output.spec", self.spec,
                   "must be a JSON list of non-empty strings for kind choice")


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
    # The answer is constrained to match this (None: free text).
    structured_output: StructuredOutput | None = None
    # token id -> value added to its logit before sampling (OpenAI's logit_bias, in [-100, 100]).
    logit_bias: dict[int, float] = {}

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in FLOAT_FIELDS:
            setattr(self, name, _finite_float(name, getattr(self, name)))
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
        _check(0 <= self.top_k <= MAX_COUNT, "top_k", self.top_k, f"must be in [0, {MAX_COUNT}] (0 disables it)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(1 <= self.max_tokens <= MAX_COUNT, "max_tokens", self.max_tokens, f"must be in [1, {MAX_COUNT}]")
        _check(self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed", self.seed,
               "must be a 64-bit integer, in [-2**63, 2**64 - 1]")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs,
               f"must be between 0 and {MAX_LOGPROBS}")
        _check(isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
            _is_int(t) and 0 <= t <= MAX_COUNT and isinstance(b, (int, float)) and not isinstance(b, bool)
            and -100 <= b <= 100 for t, b in self.logit_bias.items()), "logit_bias", self.logit_bias,
            f"must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]")
        _check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
               "structured_output", self.structured_output, "must be a StructuredOutput")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(all(len(s) <= MAX_STOP_STRING_LENGTH for s in self.stop), "stop", self.stop,
               f"each must be at most {MAX_STOP_STRING_LENGTH} characters")
        _check(all(_is_int(t) and 0 <= t <= MAX_COUNT for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, f"must be token ids in [0, {MAX_COUNT}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be true or false")

    @property
    def greedy(self) -> bool:
        # As vLLM: a temperature this small is argmax anyway, and dividing by it overflows
        # the logits to inf and NaN.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_choice_list(spec: str) -> bool:
    try:
        choices = json.loads(spec)
    except ValueError:
        return False
    return isinstance(choices, list) and bool(choices) and all(isinstance(c, str) and c for c in choices)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_float(field: str, value) -> float:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool), field, value, "must be a number")
    try:
        converted = float(value)
    except OverflowError:
        converted = math.inf
    _check(math.isfinite(converted), field, value, "must be a finite number")
    return converted


def _check(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        # Abbreviated: the value may be a client's megabyte of text, echoed back in a 400.
        raise ValueError(f"invalid sampling parameter {field}={_short_repr.repr(value)}: {rule}")


_short_repr = reprlib.Repr()
_short_repr.maxstring = _short_repr.maxother = 80
