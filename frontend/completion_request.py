"""The body of POST /v1/completions (OpenAI's legacy text completions), as a typed struct.

As for chat: every field of OpenAI's schema is declared, honoured or refused when set,
and unknown fields are refused unless --accept-unknown-fields.
"""

from __future__ import annotations



from engine.sampling_params import SamplingParams
from frontend.chat_request import sampling_params_or_invalid
from frontend.edge_decoding import Count, InvalidInput
from frontend.request_common import CommonRequestFields

# A token id in a prompt: checked against the vocabulary when the prompt is prepared.
MAX_TOKEN_ID = 2**31 - 1


class CompletionRequest(CommonRequestFields, kw_only=True, forbid_unknown_fields=True):
    # A string, a list of strings, a list of token ids, or a list of such lists (msgspec
    # takes one array type per union: the list's shape is checked in `prompts`).
    prompt: str | list
    # Reprints the prompt before the completion.
    echo: bool = False
    logprobs: Count | None = None
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
        self.check_stream_options()

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
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise InvalidInput(f"logprobs must be at most {max_logprobs} (--max-logprobs)", "invalid_value",
                               "logprobs")
        fields = self.common_sampling_fields(max_stop_strings, max_choices)
        # OpenAI's default for completions is 16 tokens.
        fields["max_tokens"] = 16 if self.max_tokens is None else self.max_tokens
        fields["logprobs"] = self.logprobs
        return sampling_params_or_invalid(fields)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID
