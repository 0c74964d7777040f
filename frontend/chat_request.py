"""The body of POST /v1/chat/completions, as a typed struct, and its sampling parameters.

Fields of the OpenAI schema that this server does not act on yet are not declared, so
they are ignored as before; the API-completeness work turns those into clear refusals.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engine.sampling_params import SamplingParams
from frontend.edge_decoding import Count, InvalidInput, Number, Seed

Role = Literal["system", "developer", "user", "assistant"]
TEXT_PART_TYPES = ("text", "input_text")


class ImageURL(msgspec.Struct):
    # A data URL, or a local file under --allowed-local-media-path; the media limits apply later.
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(msgspec.Struct):
    data: str  # base64
    format: Literal["wav", "mp3"]


class ChatContentPart(msgspec.Struct):
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


class AssistantAudio(msgspec.Struct):
    """A spoken answer sent back in the conversation: its text is its transcript."""

    id: Annotated[str, msgspec.Meta(max_length=128)]
    transcript: str | None = None


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | Annotated[list[ChatContentPart], msgspec.Meta(max_length=4096)] | None = None
    name: str | None = None
    audio: AssistantAudio | None = None

    def content_for_template(self) -> str | list[dict]:
        """A string, or the parts as dicts (text and images); bad parts are a clear error."""
        if self.content is None and self.audio is not None and self.role == "assistant":
            from frontend.chat_audio import transcript_of

            transcript = self.audio.transcript or transcript_of(self.audio.id)
            if transcript is None:
                raise InvalidInput(f"no spoken answer with audio id {self.audio.id!r} is known here (give its "
                                   "transcript as content)", "audio_expired", "messages.audio")
            return transcript
        if self.content is None:
            raise InvalidInput("a message needs content", "invalid_message", "messages.content")
        if isinstance(self.content, str):
            return self.content
        return [part.as_dict() for part in self.content]


class StreamOptions(msgspec.Struct):
    include_usage: bool = True


class AudioOutput(msgspec.Struct):
    voice: Annotated[str, msgspec.Meta(max_length=64)]  # every name speaks with the server's voice
    format: Literal["wav", "pcm16"]


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=65536)]
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
    n: Count | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=1024)] | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    user: str | None = None
    # Extension, as in vLLM: the generated token ids beside the text.
    return_token_ids: bool = False
    modalities: Annotated[list[Literal["text", "audio"]], msgspec.Meta(min_length=1, max_length=2)] | None = None
    audio: AudioOutput | None = None

    def spoken_format(self) -> str | None:
        """The answer's audio format when it is to be spoken (modalities with "audio"), else None."""
        if not self.modalities or "audio" not in self.modalities:
            return None
        if self.audio is None:
            raise InvalidInput('modalities with "audio" need "audio": {"voice": ..., "format": "wav" or "pcm16"}',
                               "invalid_value", "audio")
        return self.audio.format

    def conversation(self) -> list[dict]:
        if not self.messages:
            raise InvalidInput("the conversation is empty", "empty_conversation", "messages")
        return [{"role": m.role, "content": m.content_for_template()} for m in self.messages]

    def sampling_params(self, default_max_tokens: int, max_stop_strings: int) -> SamplingParams:
        """A bad value is an InvalidInput naming the field."""
        if self.n not in (None, 1):
            raise InvalidInput("only n=1 is supported", "unsupported_parameter", "n")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stop) > max_stop_strings:
            raise InvalidInput(f"at most {max_stop_strings} stop strings are allowed", "invalid_value", "stop")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        fields = {
            "temperature": _or(self.temperature, 1.0),
            "top_p": _or(self.top_p, 1.0),
            "top_k": _or(self.top_k, 0),
            "min_p": _or(self.min_p, 0.0),
            "seed": self.seed,
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "stop": stop,
            "presence_penalty": _or(self.presence_penalty, 0.0),
            "frequency_penalty": _or(self.frequency_penalty, 0.0),
            "repetition_penalty": _or(self.repetition_penalty, 1.0),
            "ignore_eos": self.ignore_eos,
            "logprobs": _or(self.top_logprobs, 0) if self.logprobs else None,
        }
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


def _or(value, default):
    return default if value is None else value
