"""Tool calls in the Hermes/Qwen format, read whole or streamed.

The model calls a tool by writing
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
and may write prose around its calls. One rule says what is a call, and both parsers follow
it, because the streamed one must decide before it has seen the whole block:
- A block runs from `<tool_call>` to `</tool_call>`, to the next `<tool_call>`, or to the end.
- A block that opens with `{"name": "<name>", "arguments": {` is a call from that moment, so
  its arguments can stream: they are the object that `{` opens, exactly as written, up to its
  matching brace (to the end of the text if it never closes; like OpenAI's, such arguments
  may then be invalid JSON). The rest of the block is dropped.
- Any other block is a call when its whole text is a JSON object with a non-empty string
  "name" and "arguments" that is an object, or a string holding one (its text is then the
  arguments); it streams in one piece when its block ends. Otherwise it stays content.
"""

from __future__ import annotations

import json
import re

from frontend.tool_parsers.abstract_tool_parser import (ParsedToolCall, StreamingToolParser, ToolCallDelta, ToolParser,
                                                        new_call_id)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_WS = r"[ \t\n\r]*"
# The name may hold no quote, backslash or '<', so a header never runs over a tag.
CALL_HEADER = re.compile(_WS + r'\{' + _WS + r'"name"' + _WS + ":" + _WS + r'"([^"\\<]+)"' + _WS + ","
                         + _WS + r'"arguments"' + _WS + ":" + _WS + r"\{")
_JSON_WS = re.compile(_WS)
_DECODER = json.JSONDecoder()


class HermesToolParser(ToolParser):
    """The Hermes format behind the ToolParser interface (the registry's default)."""

    def instructions(self, tools: list[dict]) -> str:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("# Tools\n\nYou may call one or more functions to help with the user's request. "
                f"Their signatures are inside <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n"
                "To call a function, write its name and arguments as a JSON object inside "
                "<tool_call></tool_call> XML tags, exactly like this:\n"
                f'{OPEN_TAG}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE_TAG}')

    def call_opening(self, name: str) -> str:
        return f'{OPEN_TAG}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def call_closing(self) -> str:
        return "}\n" + CLOSE_TAG

    def tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        return parse_tool_calls(text)

    def streaming(self) -> HermesStreamingParser:
        return HermesStreamingParser()


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a whole answer. Content is the text around the calls, stripped, or
    None when only calls were written; an answer without calls comes back as it was."""
    content, calls, pos = [], [], 0
    while (start := text.find(OPEN_TAG, pos)) >= 0:
        content.append(text[pos:start])
        body_start = start + len(OPEN_TAG)
        header = CALL_HEADER.match(text, body_start)
        if header:
            arguments_start = header.end() - 1
            end = _JsonNestingScanner().end_in(text[arguments_start:])
            arguments_end = len(text) if end is None else arguments_start + end
            calls.append(ParsedToolCall(new_call_id(), header[1], text[arguments_start:arguments_end]))
            pos = (_find_block_end(text, arguments_end) or (len(text), len(text)))[1]
            continue
        body_end, pos = _find_block_end(text, body_start) or (len(text), len(text))
        call = _call_from_block(text[body_start:body_end])
        if call:
            calls.append(ParsedToolCall(new_call_id(), *call))
        else:
            content.append(text[start:pos])
    if not calls:
        return text, []
    content.append(text[pos:])
    return "".join(content).strip() or None, calls


class HermesStreamingParser(StreamingToolParser):
    """parse_tool_calls over text that arrives in pieces: content deltas as plain strings, and
    each call's arguments as the model writes them. Text that may still turn out to be a tag
    or a call is held back until it is known."""

    def __init__(self):
        self._state = "content"  # or "block" (a call's header pending), "arguments", "after_arguments"
        self._pending = ""  # read but not yet given out
        self._next_index = 0
        self._scanner = _JsonNestingScanner()
        # Each state's reader, made once: a step runs per streamed token.
        self._readers = {"content": self._read_content, "block": self._read_block,
                         "arguments": self._read_arguments, "after_arguments": self._read_after_arguments}

    def feed(self, text: str) -> list[ToolCallDelta | str]:
        self._pending += text
        out: list[ToolCallDelta | str] = []
        while self._step(out):
            pass
        return _merged(out)

    def finish(self) -> list[ToolCallDelta | str]:
        out: list[ToolCallDelta | str] = []
        if self._state == "content":
            out.append(self._pending)
        elif self._state == "block":
            self._end_block(len(self._pending), len(self._pending), out)
        self._state, self._pending = "content", ""
        return _merged(out)

    def _step(self, out: list) -> bool:
        """Gives out what the pending text decides; False once it needs more text."""
        return self._readers[self._state](self._pending, out)

    def _read_content(self, pending: str, out: list) -> bool:
        start = pending.find(OPEN_TAG)
        if start < 0:
            keep = _partial_tag_length(pending)
            out.append(pending[:len(pending) - keep])
            self._pending = pending[len(pending) - keep:]
            return False
        out.append(pending[:start])
        self._state, self._pending = "block", pending[start + len(OPEN_TAG):]
        return True

    def _read_block(self, pending: str, out: list) -> bool:
        header = CALL_HEADER.match(pending)
        if header:
            out.append(ToolCallDelta(self._next_index, new_call_id(), header[1], ""))
            self._next_index += 1
            self._state, self._pending = "arguments", pending[header.end() - 1:]
            self._scanner = _JsonNestingScanner()
            return True
        found = _find_block_end(pending, 0)
        if found is None:
            return False
        self._end_block(*found, out)
        return True

    def _read_arguments(self, pending: str, out: list) -> bool:
        end = self._scanner.end_in(pending)
        out.append(ToolCallDelta(self._next_index - 1, None, None, pending if end is None else pending[:end]))
        self._state, self._pending = ("arguments", "") if end is None else ("after_arguments", pending[end:])
        return end is not None

    def _read_after_arguments(self, pending: str, out: list) -> bool:
        found = _find_block_end(pending, 0)
        if found is None:
            # This text is dropped; a tag not found yet can only start in its last len(OPEN_TAG) characters.
            self._pending = pending[-len(OPEN_TAG):]
            return False
        self._state, self._pending = "content", pending[found[1]:]
        return True

    def _end_block(self, body_end: int, resume: int, out: list) -> None:
        """A block without a call header ends: it is a call given out whole, or content."""
        call = _call_from_block(self._pending[:body_end])
        if call:
            out.append(ToolCallDelta(self._next_index, new_call_id(), *call))
            self._next_index += 1
        else:
            out.append(OPEN_TAG + self._pending[:resume])
        self._state, self._pending = "content", self._pending[resume:]


def _merged(items: list) -> list[ToolCallDelta | str]:
    """Adjacent content joined, a call's adjacent fragments joined, nothing empty."""
    merged: list = []
    for item in items:
        last = merged[-1] if merged else None
        if item == "" or (isinstance(item, ToolCallDelta) and item.id is None and not item.arguments):
            continue
        if isinstance(item, str) and isinstance(last, str):
            merged[-1] = last + item
        elif isinstance(item, ToolCallDelta) and isinstance(last, ToolCallDelta) and item.id is None \
                and item.index == last.index:
            merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + item.arguments)
        else:
            merged.append(item)
    return merged


def _partial_tag_length(text: str) -> int:
    """How much of text's end could be the beginning of `<tool_call>`."""
    for length in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if text.endswith(OPEN_TAG[:length]):
            return length
    return 0


def _find_block_end(text: str, pos: int) -> tuple[int, int] | None:
    """Where the block that continues at pos stops: (its text's end, where reading resumes),
    at `</tool_call>` or just before the next `<tool_call>`; None if neither comes."""
    close, reopen = text.find(CLOSE_TAG, pos), text.find(OPEN_TAG, pos)
    if close >= 0 and (reopen < 0 or close < reopen):
        return close, close + len(CLOSE_TAG)
    return (reopen, reopen) if reopen >= 0 else None


class _JsonNestingScanner:
    """Finds where a JSON object ends, a character at a time, without parsing it: it tracks only
    whether it is inside a string, just after a backslash there, and how deep the nesting is."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def end_in(self, text: str) -> int | None:
        """Consumes text; returns the index just past the brace that closes the object, if there."""
        for index, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return index + 1
        return None


def _call_from_block(body: str) -> tuple[str, str] | None:
    """(name, arguments) when a whole block is a call without the streamable header."""
    members = _object_members(body)
    if members is None:
        return None
    name = members.get("name", (None, ""))[0]
    arguments, raw = members.get("arguments", (None, ""))
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            return (name, arguments) if isinstance(json.loads(arguments), dict) else None
        except json.JSONDecodeError:
            return None
    return (name, raw) if isinstance(arguments, dict) else None


def _object_members(text: str) -> dict[str, tuple[object, str]] | None:
    """A JSON object's members, each value beside its text as written; None if text is not one object."""
    try:
        pos = _JSON_WS.match(text).end()
        if text[pos:pos + 1] != "{":
            return None
        pos, members = _JSON_WS.match(text, pos + 1).end(), {}
        while text[pos:pos + 1] != "}":
            if members and text[pos:pos + 1] != ",":
                return None
            pos = _JSON_WS.match(text, pos + (1 if members else 0)).end()
            key, pos = _DECODER.raw_decode(text, pos)
            pos = _JSON_WS.match(text, pos).end()
            if not isinstance(key, str) or text[pos:pos + 1] != ":":
                return None
            value_start = _JSON_WS.match(text, pos + 1).end()
            value, pos = _DECODER.raw_decode(text, value_start)
            members[key] = (value, text[value_start:pos])
            pos = _JSON_WS.match(text, pos).end()
    except json.JSONDecodeError:
        return None
    return members if _JSON_WS.match(text, pos + 1).end() == len(text) else None

