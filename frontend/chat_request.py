"""The body of POST /v1/chat/completions, as a typed struct, and its sampling parameters.

Every field of OpenAI's chat completions schema is declared: honoured, or refused when set
(`UNSUPPORTED`); a field the schema lacks is refused unless --accept-unknown-fields
(frontend/request_fields.py). The README's "OpenAI API" table lists what is honoured.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engine.sampling_params import SamplingParams
from frontend.edge_decoding import Count, InvalidInput
from frontend.request_common import CommonRequestFields
from frontend.request_fields import refuse_unsupported

Role = Literal["system", "developer", "user", "assistant", "tool"]
TEXT_PART_TYPES = ("text", "input_text")


class ImageURL(msgspec.Struct, forbid_unknown_fields=True):
    # A data URL, or a local file under --allowed-local-media-path; the media limits apply later.
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(msgspec.Struct, forbid_unknown_fields=True):
    data: str  # base64
    format: Literal["wav", "mp3"]


class ChatContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None

    def as_dict(self) -> dict:
        """The part as engine/chat_content.py takes it; refuses a type or a missing field."""
        if self.type in TEXT_PART_TYPES:
            if self.text is None:
                raise InvalidInput("a text content part needs a string 'text'", "invalid_value", "messages.content")
            return {"type": "text", "text": self.text}
        if self.type == "image_url":
            if self.image_url is None:
                raise InvalidInput("an image_url content part needs 'image_url': {'url': ...}", "invalid_value",
                                   "messages.content")
            return {"type": "image_url", "image_url": {"url": self.image_url.url}}
        if self.type == "input_audio":
            if self.input_audio is None:
                raise InvalidInput("an input_audio content part needs 'input_audio': {'data': ..., 'format': 'wav'}",
                                   "invalid_value", "messages.content")
            # Replaced by its transcript before the chat template sees it (frontend/chat_audio.py).
            return {"type": "input_audio", "input_audio": {"data": self.input_audio.data,
                                                           "format": self.input_audio.format}}
        raise InvalidInput(f"content part type {self.type!r} is not supported; send text, image_url or input_audio",
                           "unsupported_content_type", "messages.content")


_UNKNOWN_AUDIO_ID = ("no spoken answer with audio id {!r} is known to this API key, or it has expired (give its "
                     "transcript as content)")


class AssistantAudio(msgspec.Struct, forbid_unknown_fields=True):
    """A spoken answer sent back in the conversation: its text is its transcript."""

    id: Annotated[str, msgspec.Meta(max_length=128)]
    transcript: str | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    content: str | Annotated[list[ChatContentPart], msgspec.Meta(max_length=4096)] | None = None
    name: str | None = None
    audio: AssistantAudio | None = None
    # An assistant's earlier tool calls, and a tool message's answer to one of them.
    tool_calls: Annotated[list[ToolCall], msgspec.Meta(max_length=128)] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def content_for_template(self) -> str | list[dict]:
        """A string, or the parts as dicts (text and images); bad parts are a clear error."""
        if self.content is None and self.audio is not None and self.role == "assistant":
            if self.audio.transcript is None:
                raise InvalidInput(_UNKNOWN_AUDIO_ID.format(self.audio.id), "audio_expired", "messages.audio")
            return self.audio.transcript
        if self.content is None and (self.tool_calls or self.refusal is not None):
            return self.refusal or ""
        if self.content is None:
            raise InvalidInput("a message needs content", "invalid_message", "messages.content")
        if isinstance(self.content, str):
            return self.content
        return [part.as_dict() for part in self.content]


class AudioOutput(msgspec.Struct, forbid_unknown_fields=True):
    # With the cascade every name speaks with the server's one voice; an omni model's speakers
    # are its voices.
    voice: Annotated[str, msgspec.Meta(max_length=64)]
    format: Literal["wav", "pcm16"]


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: str
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["function"]
    function: NamedFunction


# OpenAI fields this server knows and does not act on: refused unless set to a value that
# asks for nothing (frontend/request_fields.py). `store` true would keep answers for a
# dashboard that does not exist here; reasoning, web search, predictions: no such models.
UNSUPPORTED = {"store": (False,), "service_tier": ("auto", "default"), "reasoning_effort": (),
               "verbosity": (), "prediction": (), "web_search_options": (), "functions": (), "function_call": ()}


class ChatCompletionRequest(CommonRequestFields, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=65536)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    # Accepted, like user and metadata: this server keeps no per-user state, and prefix
    # caching needs no key.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    modalities: Annotated[list[Literal["text", "audio"]], msgspec.Meta(min_length=1, max_length=2)] | None = None
    audio: AudioOutput | None = None
    # Tools.
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Declared to be refused when set (UNSUPPORTED).
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None

    def check_supported(self) -> None:
        refuse_unsupported(self, UNSUPPORTED)
        self.check_stream_options()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidInput("top_logprobs needs logprobs: true", "invalid_value", "top_logprobs")

    def spoken_format(self) -> str | None:
        """The answer's audio format when it is to be spoken (modalities with "audio"), else None."""
        if not self.modalities or "audio" not in self.modalities:
            return None
        if self.audio is None:
            raise InvalidInput('modalities with "audio" need "audio": {"voice": ..., "format": "wav" or "pcm16"}',
                               "invalid_value", "audio")
        return self.audio.format

    def recall_spoken_answers(self, store, tenant: str) -> None:
        """Puts the transcript of every spoken answer sent back by id (and without content) in
        its place. An id this tenant's requests did not get, or one past its expiry, is refused
        with the same error whether or not it exists: ids are not to be probed."""
        for message in self.messages or ():
            if message.content is None and message.audio is not None and message.audio.transcript is None:
                transcript = store.transcript_of(tenant, message.audio.id)
                if transcript is None:
                    raise InvalidInput(_UNKNOWN_AUDIO_ID.format(message.audio.id), "audio_expired",
                                       "messages.audio")
                message.audio.transcript = transcript

    def conversation(self) -> list[dict]:
        if not self.messages:
            raise InvalidInput("the conversation is empty", "empty_conversation", "messages")
        out = []
        for m in self.messages:
            message = {"role": m.role, "content": m.content_for_template()}
            if m.tool_calls:
                message["tool_calls"] = [msgspec.to_builtins(call) for call in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":
                message["name"] = m.name
            out.append(message)
        return out

    def sampling_params(self, default_max_tokens: int, max_stop_strings: int, max_logprobs: int = 20,
                        max_choices: int = 16) -> SamplingParams:
        """A bad value is an InvalidInput naming the field."""
        if self.logprobs and (self.top_logprobs or 0) > max_logprobs:
            raise InvalidInput(f"top_logprobs must be at most {max_logprobs} (--max-logprobs)", "invalid_value",
                               "top_logprobs")
        fields = self.common_sampling_fields(max_stop_strings, max_choices)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        fields["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
        fields["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return sampling_params_or_invalid(fields, {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"
                                                   if self.max_completion_tokens is not None else "max_tokens"})


def sampling_params_or_invalid(fields: dict, param_names: dict | None = None) -> SamplingParams:
    """SamplingParams(**fields), with its ValueError turned into InvalidInput naming the field."""
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        field = next((name for name in fields if f" {name}=" in f" {exc}"), None)
        param = (param_names or {}).get(field, field)
        raise InvalidInput(str(exc), "invalid_value", param) from None
