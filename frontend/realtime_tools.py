"""Realtime function calling and structured output.

A session's `tools` (Realtime's flat shape: type, name, description, parameters) and
`tool_choice` work as in chat completions (frontend/tool_specs.py, frontend/tool_parsers/): the
model writes calls in the server's tool-call format (Hermes' `<tool_call>` blocks), forced by
a grammar for "required" or a named function, and each call
streams out as a `function_call` output item (`response.function_call_arguments.delta` /
`.done`). The client answers with a `function_call_output` item and asks for the next
response. Extension: `response_format` (chat's shape) constrains a session's or one
response's text.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.sampling_params import StructuredOutput
from frontend.edge_decoding import InvalidInput
from frontend.structured_output import ResponseFormat, forced_call_grammar, structured_output_of
from frontend.tool_parsers import ToolCallDelta, ToolParser
from frontend.tool_specs import ToolSpecError, validate_tools


class RealtimeTool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None


class NamedTool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


ToolChoice = Literal["auto", "none", "required"] | NamedTool


def chat_tools(tools: list[dict]) -> list[dict]:
    return [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in tools]


def chat_tool_choice(choice):
    return {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) else choice


def check_tools(settings: dict, where: str, max_tools: int) -> None:
    """A session's or a response's tools and tool_choice, as InvalidInput naming the field."""
    tools = settings.get("tools") or []
    if len(tools) > max_tools:
        raise InvalidInput(f"at most {max_tools} tools (--max-tools)", "invalid_value", f"{where}.tools")
    try:
        validate_tools(chat_tools(tools), chat_tool_choice(settings.get("tool_choice", "auto")))
    except ToolSpecError as exc:
        param = exc.param.replace(".function", "")
        raise InvalidInput(str(exc), "invalid_value", f"{where}.{param}") from None


async def constraint_of(settings: dict, where: str, max_grammar_bytes: int,
                        parser: ToolParser) -> tuple[StructuredOutput, str] | None:
    """What a response's text must match: a forced tool call, or the response_format."""
    tools, choice = settings.get("tools") or [], settings.get("tool_choice", "auto")
    response_format = settings.get("response_format")
    constraint = None
    if response_format is not None:
        spec, _ = structured_output_of(msgspec.convert(response_format, ResponseFormat),
                                       max_bytes=max_grammar_bytes) or (None, None)
        constraint = (spec, f"{where}.response_format") if spec is not None else None
    grammar = await forced_call_grammar(chat_tools(tools), chat_tool_choice(choice), None,
                                        max_grammar_bytes, parser) if tools else None
    if grammar is None:
        return constraint
    if constraint is not None:
        raise InvalidInput("response_format cannot be combined with a tool_choice that forces a call",
                           "invalid_value", f"{where}.response_format")
    return grammar, f"{where}.tool_choice"


def conversation_messages(items: list[dict], message_content) -> list[dict]:
    """Chat messages for the template: messages as they are (`message_content(item)` gives
    their content), a run of function_call items as one assistant message with tool_calls,
    and each function_call_output as a tool message."""
    messages: list[dict] = []
    for item in items:
        kind = item["type"]
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            messages.append({"role": item["role"], "content": message_content(item)})
    return messages


class FunctionCallStream:
    """One response's text split into what it says and the function calls it makes, each
    call streamed as its own output item after the message item."""

    def __init__(self, send, response_id: str, new_item_id, parser: ToolParser, first_output_index: int = 1) -> None:
        self.send = send
        self.response_id = response_id
        self.new_item_id = new_item_id
        self.first_output_index = first_output_index
        self.parser = parser.streaming()
        self.items: list[dict] = []

    async def feed(self, text: str, final: bool = False) -> str:
        """The part of `text` that is said (the calls' text goes out as their events)."""
        pieces = self.parser.feed(text)
        if final:
            pieces += self.parser.finish()
        said = []
        for piece in pieces:
            if isinstance(piece, ToolCallDelta):
                await self._call_delta(piece)
            else:
                said.append(piece)
        return "".join(said)

    async def _call_delta(self, delta: ToolCallDelta) -> None:
        # Recorded only once sent: a cancel between two sends leaves the items and their
        # arguments as the client saw them, and close() matches that.
        if delta.id is not None:
            item = {"id": self.new_item_id(), "object": "realtime.item", "type": "function_call",
                    "status": "in_progress", "call_id": delta.id, "name": delta.name, "arguments": ""}
            await self.send({"type": "response.output_item.added", "response_id": self.response_id,
                             "output_index": self.first_output_index + len(self.items), "item": dict(item)})
            self.items.append(item)
        item = self.items[delta.index]
        if delta.arguments:
            await self.send({"type": "response.function_call_arguments.delta", **self._where(item),
                             "delta": delta.arguments})
            item["arguments"] += delta.arguments

    async def close(self, completed: bool) -> None:
        """Every call's closing events; a call cut short (cancelled, length) is incomplete."""
        for item in self.items:
            item["status"] = "completed" if completed else "incomplete"
            await self.send({"type": "response.function_call_arguments.done", **self._where(item),
                             "name": item["name"], "arguments": item["arguments"]})
            await self.send({"type": "response.output_item.done", "response_id": self.response_id,
                             "output_index": self._index(item), "item": item})

    def _index(self, item: dict) -> int:
        return self.first_output_index + self.items.index(item)

    def _where(self, item: dict) -> dict:
        return {"response_id": self.response_id, "item_id": item["id"], "output_index": self._index(item),
                "call_id": item["call_id"]}
