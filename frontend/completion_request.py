"""The body of POST /v1/completions (OpenAI's legacy text completions), as a typed struct.

As for chat: every field of OpenAI's schema is declared, honoured or refused when set,
and unknown fields are refused unless --accept-unknown-fields.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from engine.sampling_params import SamplingParams
from frontend.chat_request import StreamOptions, logit_bias_of, sampling_params_or_invalid
from frontend.edge_decoding import Count, InvalidInput, Number, Seed
from frontend.structured_output import ResponseFormat

# A token id in a prompt: checked against the vocabulary when the prompt is prepared.
MAX_TOKEN_ID = 2**31 - 1


class CompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # A string, a list of strings, a list of token ids, or a list of such lists (msgspec
    # takes one array type per union: the list's shape is checked in `prompts`).
    prompt: str | list
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Reprints the prompt before the completion.
    echo: bool = False
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
    logprobs: Count | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], msgspec.Meta(max_length=4096)] | None = None
    guided_grammar: str | None = None
    # Refused when set: insertion needs a fill-in-the-middle model; best_of ranks answers by
    # logprob server-side, which this server does not do (ask for n and rank them yourself).
    suffix: str | None = None
    best_of: Count | None = None

    def check_supported(self) -> None:
        if self.suffix:
            raise InvalidInput("suffix (inserting text) is not supported by this server", "unsupported_parameter",
                               "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidInput("best_of is not supported by this server: ask for n choices instead",
                               "unsupported_parameter", "best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidInput("echo with logprobs needs the prompt's log-probabilities, which this server does "
                               "not compute", "unsupported_parameter", "echo")
        if self.stream_options is not None and not self.stream:
            raise InvalidInput("stream_options needs stream: true", "invalid_value", "stream_options")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise InvalidInput("stream_options.include_obfuscation is not supported by this server",
                               "unsupported_parameter", "stream_options.include_obfuscation")

    def prompts(self, max_prompts: int) -> list[str | list[int]]:
        """The prompts of the batch: strings or token id lists."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(_is_token_id(t) for t in prompt)):
            prompts = [prompt]
        else:
            prompts = prompt
        if not prompts:
            raise InvalidInput("prompt is empty", "empty_prompt", "prompt")
        for index, item in enumerate(prompts):
            if not (isinstance(item, str) or (isinstance(item, list) and item
                                              and all(_is_token_id(t) for t in item))):
                raise InvalidInput("prompt must be a string, a list of strings, a list of token ids or a list of "
                                   "such lists", "invalid_value", f"prompt[{index}]")
        if len(prompts) > max_prompts:
            raise InvalidInput(f"at most {max_prompts} prompts per request (--max-prompts-per-request)",
                               "invalid_value", "prompt")
        return prompts

    def sampling_params(self, max_stop_strings: int, max_logprobs: int, max_choices: int) -> SamplingParams:
        if self.n is not None and not 1 <= self.n <= max_choices:
            raise InvalidInput(f"n must be between 1 and {max_choices} (--max-choices)", "invalid_value", "n")
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise InvalidInput(f"logprobs must be at most {max_logprobs} (--max-logprobs)", "invalid_value",
                               "logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stop) > max_stop_strings:
            raise InvalidInput(f"at most {max_stop_strings} stop strings are allowed", "invalid_value", "stop")
        fields = {
            "temperature": _or(self.temperature, 1.0), "top_p": _or(self.top_p, 1.0), "top_k": _or(self.top_k, 0),
            "min_p": _or(self.min_p, 0.0), "seed": self.seed,
            # OpenAI's default for completions is 16 tokens.
            "max_tokens": _or(self.max_tokens, 16), "stop": stop,
            "presence_penalty": _or(self.presence_penalty, 0.0),
            "frequency_penalty": _or(self.frequency_penalty, 0.0),
            "repetition_penalty": _or(self.repetition_penalty, 1.0), "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs, "logit_bias": logit_bias_of(self.logit_bias),
        }
        return sampling_params_or_invalid(fields)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def _or(value, default):
    return default if value is None else value
