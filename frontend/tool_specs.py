"""A request's `tools` and `tool_choice`: their checks, and how the conversation tells the
model about them.

Checks come first so that a bad tool is one 400 naming its field, before any grammar or
template work. A chat template that renders `tools` itself (Qwen2.5, Llama 3.1) gets them as
they came; for any other template the tools, past calls and tool answers are written into
the messages as text in the format of the server's tool parser (frontend/tool_parsers/), the
one it reads back.
"""

from __future__ import annotations

import json
import re

from frontend.tool_parsers import ToolParser

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class ToolSpecError(ValueError):
    """A bad `tools`, `tool_choice` or tool call in a request; `param` names the field for the 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def validate_tools(tools: list[dict] | None, tool_choice) -> None:
    names: set[str] = set()
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolSpecError('each tool needs "type": "function"', f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolSpecError('a function tool needs "function": {"name": ...}', f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ToolSpecError("a function name is 1 to 64 letters, digits, '_' or '-'", f"{where}.function.name")
        if name in names:
            raise ToolSpecError(f"the function name {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ToolSpecError("a function description is a string", f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
            raise ToolSpecError("parameters is a JSON schema of an object", f"{where}.function.parameters")
        if not isinstance(function.get("strict", False), bool):
            raise ToolSpecError("strict is true or false", f"{where}.function.strict")
    if tool_choice in (None, "auto", "none"):
        return
    chosen = chosen_name(tool_choice)
    if tool_choice != "required" and chosen is None:
        raise ToolSpecError('tool_choice is "auto", "none", "required" or '
                            '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if not names:
        raise ToolSpecError("tool_choice asks for a tool call but no tools are given", "tool_choice")
    if chosen is not None and chosen not in names:
        raise ToolSpecError(f"tool_choice names {chosen!r}, which is not among the tools", "tool_choice")


def chosen_name(tool_choice) -> str | None:
    """The function a named tool_choice asks for, or None if tool_choice is not that form."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        return name if isinstance(name, str) else None
    return None


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template renders `tools` itself (Qwen2.5, Llama 3.1) rather than ignoring them."""
    if not chat_template:
        return False
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        # Some templates use tags only transformers defines ({% generation %}); a whole-word match must do.
        return re.search(r"\btools\b", chat_template) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def prepare_conversation(messages: list[dict], tools: list[dict] | None, native: bool,
                         parser: ToolParser) -> tuple[list[dict], dict]:
    """(messages, extra keyword arguments) for apply_chat_template. A native template gets the
    tools as they came (Qwen's dumps each whole `{"type": "function", ...}`) and call arguments
    as dicts (it dumps those too); any other template gets everything written in as text, in
    `parser`'s format."""
    if native:
        return [_native_message(m, i) for i, m in enumerate(messages)], ({"tools": list(tools)} if tools else {})
    converted = [_text_message(m, i, parser) for i, m in enumerate(messages)]
    if not tools:
        return converted, {}
    instructions = parser.instructions(tools)
    if converted and converted[0]["role"] in ("system", "developer"):
        first = converted[0]
        return [{**first, "content": _append_text(first["content"], instructions)}, *converted[1:]], {}
    return [{"role": "system", "content": instructions}, *converted], {}


def _native_message(message: dict, index: int) -> dict:
    converted = {**message, "content": _or_empty(message.get("content"))}
    if message.get("tool_calls"):
        converted["tool_calls"] = [
            {**call, "function": {**function, "arguments": _arguments_value(function.get("arguments"))}}
            for call, function in _called_functions(message, index)]
    return converted


def _text_message(message: dict, index: int, parser: ToolParser) -> dict:
    role, content = message["role"], message.get("content")
    if role == "tool":
        return {"role": "tool", "content": parser.tool_result(_text_of(content))}
    if role == "assistant" and message.get("tool_calls"):
        blocks = [parser.call_text(function["name"], _arguments_value(function.get("arguments")))
                  for _, function in _called_functions(message, index)]
        calls, text = parser.call_separator.join(blocks), _text_of(content)
        return {"role": "assistant", "content": f"{text}\n{calls}" if text else calls}
    return {"role": role, "content": _or_empty(content)}


def _called_functions(message: dict, index: int) -> list[tuple[dict, dict]]:
    pairs = []
    for number, call in enumerate(message["tool_calls"]):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolSpecError("a tool call needs function.name", f"messages[{index}].tool_calls[{number}].function")
        pairs.append((call, function))
    return pairs


def _arguments_value(arguments):
    """Arguments as an object where the JSON text allows; text that is not an object stays text."""
    if not isinstance(arguments, str):
        return {} if arguments is None else arguments
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _text_of(content) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return _or_empty(content)


def _append_text(content, text: str):
    if isinstance(content, list):
        return [*content, {"type": "text", "text": "\n\n" + text}]
    return f"{content}\n\n{text}" if content else text


def _or_empty(content):
    return "" if content is None else content
