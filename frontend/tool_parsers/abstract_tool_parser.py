"""What every tool-call format gives the handlers, whatever the model's format.

Model families write their calls differently (Hermes' `<tool_call>` JSON blocks, Llama's
`<|python_tag|>`, Mistral's `[TOOL_CALLS]`); the chat and Realtime handlers need only these
things from any of them, so a new format is a new `ToolParser`, not a change to a handler:
- a whole answer split into its content and its calls (non-streamed responses);
- a stream of pieces as the text arrives: content as strings, each call as deltas whose
  first one names it and whose arguments follow as the model writes them;
- how the format is written, for the text that tells a model without a tool-aware chat
  template about its tools (frontend/tool_specs.py) and for the grammar that forces a call
  (frontend/tool_call_grammar.py): both then agree with the parser by construction.
"""

from __future__ import annotations

import json
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

    # How the format is written. A format defines all of these together, and its parse()
    # reads back what they write: the prompt asks for it and the forcing grammar admits it.

    # Between two calls of one answer.
    call_separator = "\n"

    @abstractmethod
    def instructions(self, tools: list[dict]) -> str:
        """System text that lists `tools` and says how to call one in this format."""

    @abstractmethod
    def call_opening(self, name: str) -> str:
        """A call's text before its arguments (a JSON object): what the model writes to call `name`."""

    @abstractmethod
    def call_closing(self) -> str:
        """A call's text after its arguments."""

    @abstractmethod
    def tool_result(self, content: str) -> str:
        """A tool's answer as the model reads it in the conversation."""

    def call_text(self, name: str, arguments) -> str:
        """A past call written as the model is asked to write one (`arguments`: an object, or
        text that is not one, kept as a string)."""
        return self.call_opening(name) + json.dumps(arguments, ensure_ascii=False) + self.call_closing()


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_calls_json(calls: list[ParsedToolCall]) -> list[dict]:
    """Calls as OpenAI's `message.tool_calls`."""
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]
