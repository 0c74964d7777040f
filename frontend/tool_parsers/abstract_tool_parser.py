"""What every tool-call parser gives the handlers, whatever the model's format.

Model families write their calls differently (Hermes' `<tool_call>` JSON blocks, Llama's
`<|python_tag|>`, Mistral's `[TOOL_CALLS]`); the chat and Realtime handlers need only two
things from any of them, so a new format is a new `ToolParser`, not a change to a handler:
- a whole answer split into its content and its calls (non-streamed responses), and
- a stream of pieces as the text arrives: content as strings, each call as deltas whose
  first one names it and whose arguments follow as the model writes them.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of the arguments object as the model wrote it


@dataclass
class ToolCallDelta:
    index: int
    id: str | None  # id and name come with a call's first delta only
    name: str | None
    arguments: str


class StreamingToolParser(ABC):
    """One answer read as it arrives. Text that may still turn out to be part of a call is held
    back until it is known, so content never shows a call's text."""

    @abstractmethod
    def feed(self, text: str) -> list[ToolCallDelta | str]:
        """What the text so far decides: content as strings, calls as deltas; nothing empty."""

    @abstractmethod
    def finish(self) -> list[ToolCallDelta | str]:
        """What was held back, decided now that the answer has ended."""


class ToolParser(ABC):
    """One format of tool calls: read whole, or streamed with the same outcome."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a whole answer. Content is the text around the calls, or None
        when only calls were written; an answer without calls comes back as it was."""

    @abstractmethod
    def streaming(self) -> StreamingToolParser:
        """A fresh parser for one streamed answer."""


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_calls_json(calls: list[ParsedToolCall]) -> list[dict]:
    """Calls as OpenAI's `message.tool_calls`."""
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]
