"""Realtime client events as typed structs (GA names, with the beta aliases accepted).

`decode_client_event` turns one WebSocket message into one of these or raises
InvalidInput naming the field. Settings a client leaves out stay UNSET, so an update
changes only what it names.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

from frontend.edge_decoding import Count, InvalidInput, Number, Seed
from frontend.realtime_tools import RealtimeTool, ToolChoice
from frontend.request_fields import decode_request
from frontend.structured_output import ResponseFormat

TEXT_PART_TYPES = ("input_text", "text", "output_text")
MaxOutputTokens = Count | Literal["inf"]


class MessagePart(msgspec.Struct, forbid_unknown_fields=True):
    """Text, or (in a user message) an image as a data URL (the media limits apply later) or
    audio (base64 in the session's input format; its transcript becomes the text)."""

    type: str
    text: str | None = None
    image_url: str | None = None
    audio: str | None = None
    transcript: str | None = None
    # An image's detail: only "auto" (the model's own preprocessing decides the resolution).
    detail: Literal["auto"] | None = None


class MessageItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A conversation item: a message, a function call the model made, or its output."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "assistant"] | None = None
    content: Annotated[list[MessagePart], msgspec.Meta(min_length=1, max_length=4096)] | None = None
    id: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    object: Literal["realtime.item"] | None = None
    status: str | None = None
    # function_call and function_call_output items.
    call_id: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    name: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    arguments: str | None = None
    output: str | None = None

    def function_fields(self) -> dict:
        """A function_call / function_call_output item's own fields, checked."""
        needed = ("call_id", "name", "arguments") if self.type == "function_call" else ("call_id", "output")
        for name in needed:
            if getattr(self, name) is None:
                raise InvalidInput(f"a {self.type} item needs {name!r}", "invalid_value", f"item.{name}")
        if self.role is not None or self.content is not None:
            raise InvalidInput(f"a {self.type} item has no role or content", "invalid_value", "item.content")
        return {name: getattr(self, name) for name in needed}

    def parts(self) -> list[dict]:
        """The parts as dicts; a part of an unsupported type or without its field is refused."""
        if self.role is None or self.content is None:
            raise InvalidInput("a message item needs a role and content", "invalid_value", "item")
        for name in ("call_id", "name", "arguments", "output"):
            if getattr(self, name) is not None:
                raise InvalidInput(f"a message item has no {name!r} (that is a function_call item's)",
                                   "invalid_value", f"item.{name}")
        parts = []
        for part in self.content:
            if part.type in TEXT_PART_TYPES:
                if part.text is None:
                    raise InvalidInput("a text content part needs a string 'text'", "invalid_value", "item.content")
                parts.append({"type": part.type, "text": part.text})
            elif part.type == "input_audio" and self.role == "user":
                if part.audio is None:
                    raise InvalidInput("an input_audio part needs 'audio' (base64 in the session's input format)",
                                       "invalid_value", "item.content")
                parts.append({"type": "input_audio", "audio": part.audio, "transcript": None})
            elif part.type == "input_image" and self.role == "user":
                if part.image_url is None:
                    raise InvalidInput("an input_image part needs 'image_url' (a data URL)", "invalid_value",
                                       "item.content")
                parts.append({"type": "input_image", "image_url": part.image_url})
            else:
                raise InvalidInput(f"content part type {part.type!r} is not supported here; send input_text"
                                   + (" or input_image" if self.role == "user" else ""),
                                   "unsupported_content_type", "item.content")
        return parts


AudioFormatType = Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
# Beta names of the formats.
BETA_AUDIO_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


class AudioFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: AudioFormatType
    rate: Literal[24000, 8000] | UnsetType = UNSET


class TurnDetection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["server_vad"]
    threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | UnsetType = UNSET
    prefix_padding_ms: Annotated[int, msgspec.Meta(ge=0, le=5000)] | UnsetType = UNSET
    silence_duration_ms: Annotated[int, msgspec.Meta(ge=100, le=10000)] | UnsetType = UNSET
    create_response: bool | UnsetType = UNSET
    interrupt_response: bool | UnsetType = UNSET


class Transcription(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | UnsetType = UNSET
    language: Literal["en"] | UnsetType = UNSET


class AudioInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: AudioFormat | UnsetType = UNSET
    turn_detection: TurnDetection | None | UnsetType = UNSET
    transcription: Transcription | None | UnsetType = UNSET
    noise_reduction: None | UnsetType = UNSET


class AudioOutput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: AudioFormat | UnsetType = UNSET
    voice: Annotated[str, msgspec.Meta(max_length=64)] | UnsetType = UNSET
    speed: Annotated[float, msgspec.Meta(ge=0.25, le=1.5)] | UnsetType = UNSET


class SessionAudio(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: AudioInput | UnsetType = UNSET
    output: AudioOutput | UnsetType = UNSET


class SessionSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str | UnsetType = UNSET
    model: str | UnsetType = UNSET
    output_modalities: Annotated[list[Literal["text", "audio"]], msgspec.Meta(max_length=2)] | UnsetType = UNSET
    modalities: Annotated[list[Literal["text", "audio"]], msgspec.Meta(max_length=2)] | UnsetType = UNSET
    instructions: str | UnsetType = UNSET
    max_output_tokens: MaxOutputTokens | UnsetType = UNSET
    max_response_output_tokens: MaxOutputTokens | UnsetType = UNSET
    temperature: Number | UnsetType = UNSET
    top_p: Number | UnsetType = UNSET
    seed: Seed | None | UnsetType = UNSET
    audio: SessionAudio | UnsetType = UNSET
    # Beta names of the audio settings.
    input_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw"] | UnsetType = UNSET
    output_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw"] | UnsetType = UNSET
    turn_detection: TurnDetection | None | UnsetType = UNSET
    input_audio_transcription: Transcription | None | UnsetType = UNSET
    voice: Annotated[str, msgspec.Meta(max_length=64)] | UnsetType = UNSET
    # Function calling (frontend/realtime_tools.py), and structured output (an extension).
    tools: Annotated[list[RealtimeTool], msgspec.Meta(max_length=4096)] | UnsetType = UNSET
    tool_choice: ToolChoice | UnsetType = UNSET
    response_format: ResponseFormat | None | UnsetType = UNSET
    # Extras in events: "response.output_text.logprobs" (an extension: each text delta with
    # its tokens' logprobs); OpenAI's "item.input_audio_transcription.logprobs" is refused.
    include: Annotated[list[str], msgspec.Meta(max_length=8)] | None | UnsetType = UNSET
    # Refused unless they ask for what the server does anyway (UNSUPPORTED_SESSION_FIELDS).
    truncation: str | dict | None | UnsetType = UNSET
    tracing: str | dict | None | UnsetType = UNSET
    prompt: dict | None | UnsetType = UNSET
    input_audio_noise_reduction: dict | None | UnsetType = UNSET
    # Echoed back by clients that send the session object they were given: ignored.
    id: str | UnsetType = UNSET
    object: str | UnsetType = UNSET
    expires_at: int | UnsetType = UNSET


# Session fields this server knows but does not act on, with the values that ask for nothing
# it lacks (UNSET and None always do): older items are dropped when the conversation is full,
# which is truncation "auto".
UNSUPPORTED_SESSION_FIELDS = {"truncation": ("auto",), "tracing": (), "prompt": (),
                              "input_audio_noise_reduction": ()}


# A response's metadata: echoed in its response object (OpenAI's bounds).
Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
                     msgspec.Meta(max_length=16)]


class ResponseOptions(SessionSettings, kw_only=True):
    conversation: Literal["auto", "none"] | UnsetType = UNSET
    metadata: Metadata | None | UnsetType = UNSET
    input: Annotated[list[MessageItem], msgspec.Meta(max_length=4096)] | UnsetType = UNSET


class SessionUpdate(msgspec.Struct, tag="session.update", tag_field="type", kw_only=True):
    session: SessionSettings
    event_id: str | None = None


class ItemCreate(msgspec.Struct, tag="conversation.item.create", tag_field="type", kw_only=True):
    item: MessageItem
    previous_item_id: str | None = None
    event_id: str | None = None


class ItemDelete(msgspec.Struct, tag="conversation.item.delete", tag_field="type", kw_only=True):
    item_id: str
    event_id: str | None = None


class ItemRetrieve(msgspec.Struct, tag="conversation.item.retrieve", tag_field="type", kw_only=True):
    item_id: str
    event_id: str | None = None


class ItemTruncate(msgspec.Struct, tag="conversation.item.truncate", tag_field="type", kw_only=True):
    item_id: str
    content_index: Count
    audio_end_ms: Count
    event_id: str | None = None


class ResponseCreate(msgspec.Struct, tag="response.create", tag_field="type", kw_only=True):
    response: ResponseOptions = msgspec.field(default_factory=ResponseOptions)
    event_id: str | None = None


class ResponseCancel(msgspec.Struct, tag="response.cancel", tag_field="type", kw_only=True):
    response_id: str | None = None
    event_id: str | None = None


class AudioAppend(msgspec.Struct, tag="input_audio_buffer.append", tag_field="type", kw_only=True):
    audio: str  # base64, in the session's input format
    event_id: str | None = None


class AudioCommit(msgspec.Struct, tag="input_audio_buffer.commit", tag_field="type", kw_only=True):
    event_id: str | None = None


class AudioClear(msgspec.Struct, tag="input_audio_buffer.clear", tag_field="type", kw_only=True):
    event_id: str | None = None


ClientEvent = (SessionUpdate | ItemCreate | ItemDelete | ItemRetrieve | ItemTruncate | ResponseCreate | ResponseCancel
               | AudioAppend | AudioCommit | AudioClear)
EVENT_TYPES = frozenset(t.__struct_config__.tag for t in ClientEvent.__args__)


class _Envelope(msgspec.Struct):
    type: str | None = None
    event_id: str | None = None


def decode_client_event(data: bytes | str, accept_unknown_fields: bool = False) -> ClientEvent:
    try:
        return decode_request(data, ClientEvent, accept_unknown_fields, "event")
    except InvalidInput as exc:
        envelope = _envelope(data)
        if exc.code == "invalid_value" and exc.param == "type":
            if isinstance(envelope.type, str) and envelope.type not in EVENT_TYPES:
                exc = InvalidInput(f"unknown event type {envelope.type!r}", "unknown_event_type", "type")
        elif exc.code == "invalid_value" and exc.param is None and envelope.type is None:
            exc = InvalidInput("an event is a JSON object with a string 'type'", "invalid_event", "type")
        exc.event_id = envelope.event_id
        raise exc


def _envelope(data: bytes | str) -> _Envelope:
    """The type and event id of a message that failed to decode, where they can be read."""
    try:
        return msgspec.json.decode(data, type=_Envelope)
    except (msgspec.MsgspecError, RecursionError):
        return _Envelope()
