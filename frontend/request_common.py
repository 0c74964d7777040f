"""What chat completions and completions requests share: their sampling fields, stream
options, structured output and accepted metadata, and the checks and sampling parameters
made from them. Each request struct adds its own fields (messages and tools; a prompt)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from frontend.edge_decoding import Count, InvalidInput, Number, Seed
from frontend.structured_output import ResponseFormat, structured_output_of


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    # As OpenAI: a stream ends with a usage chunk (its `choices` empty) only when asked, since
    # readers written for OpenAI take `chunk.choices[0]` of every chunk.
    include_usage: bool = False
    # Random padding against length side channels: not added by this server (refused if true).
    include_obfuscation: bool | None = None


class CommonRequestFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Count | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    n: Count | None = None
    max_tokens: Count | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=1024)] | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    # Accepted: who asks and for what; this server keeps no per-user state and no metadata.
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Extension, as in vLLM: the generated token ids beside the text.
    return_token_ids: bool = False
    # Structured output, and vLLM's guided decoding extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], msgspec.Meta(max_length=4096)] | None = None
    guided_grammar: str | None = None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidInput("stream_options needs stream: true", "invalid_value", "stream_options")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise InvalidInput("stream_options.include_obfuscation is not supported by this server",
                               "unsupported_parameter", "stream_options.include_obfuscation")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self, max_grammar_bytes: int):
        return structured_output_of(self.response_format, self.guided_json, self.guided_regex, self.guided_choice,
                                    self.guided_grammar, max_grammar_bytes)

    def common_sampling_fields(self, max_stop_strings: int, max_choices: int) -> dict:
        """SamplingParams fields both endpoints read the same way (max_tokens and logprobs
        are each endpoint's own); a bad n or too many stop strings is an InvalidInput."""
        if self.n is not None and not 1 <= self.n <= max_choices:
            raise InvalidInput(f"n must be between 1 and {max_choices} (--max-choices)", "invalid_value", "n")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stop) > max_stop_strings:
            raise InvalidInput(f"at most {max_stop_strings} stop strings are allowed", "invalid_value", "stop")
        return {
            "temperature": _or(self.temperature, 1.0), "top_p": _or(self.top_p, 1.0), "top_k": _or(self.top_k, 0),
            "min_p": _or(self.min_p, 0.0), "seed": self.seed, "stop": stop,
            "presence_penalty": _or(self.presence_penalty, 0.0),
            "frequency_penalty": _or(self.frequency_penalty, 0.0),
            "repetition_penalty": _or(self.repetition_penalty, 1.0), "ignore_eos": self.ignore_eos,
            "logit_bias": logit_bias_of(self.logit_bias),
        }


def logit_bias_of(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) as token id -> bias."""
    out = {}
    for key, value in (bias or {}).items():
        # ASCII digits only: str.isdigit is also true of "²" and "٣", which int() refuses or reads.
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise InvalidInput(f"logit_bias keys must be token ids, not {key[:20]!r}", "invalid_value", "logit_bias")
        if not -100 <= value <= 100:
            raise InvalidInput("logit_bias values must be in [-100, 100]", "invalid_value", "logit_bias")
        out[int(key)] = float(value)
    return out


def _or(value, default):
    return default if value is None else value
