"""Tool-call parsers by name, and the interface the handlers use (abstract_tool_parser.py).

Handlers use the parser the generation service chose once (`parser_for(name)`) and never
name a format: adding one is a module here and a line in TOOL_PARSERS. The parser also says
how its format is written, so the prompt for templates that do not render tools themselves
(frontend/tool_specs.py) and the grammar that forces a call (frontend/tool_call_grammar.py)
follow it. "hermes" is the default: the format Qwen2.5's own chat template asks for.
"""

from __future__ import annotations

from frontend.tool_parsers.abstract_tool_parser import (ParsedToolCall, StreamingToolParser, ToolCallDelta, ToolParser,
                                                        tool_calls_json)
from frontend.tool_parsers.hermes_tool_parser import HermesToolParser

DEFAULT_TOOL_PARSER = "hermes"
TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}

__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "ParsedToolCall", "StreamingToolParser", "ToolCallDelta",
           "ToolParser", "parser_for", "tool_calls_json"]


def parser_for(name: str = DEFAULT_TOOL_PARSER) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"no tool parser named {name!r}; there are {', '.join(sorted(TOOL_PARSERS))}") from None
