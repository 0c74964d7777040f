"""The grammar that forces a tool call when `tool_choice` is "required" or names a function.

It admits exactly calls as the server's tool parser writes them (its call_opening, the
arguments, its call_closing; frontend/tool_parsers/), each call's arguments held to its tool's
parameters schema, so a forced answer always parses into calls. It is compiled and bounded
like any client grammar (frontend/structured_output.py, forced_call_grammar).
"""

from __future__ import annotations

import json

from frontend.tool_parsers import ToolParser
from frontend.tool_specs import ToolSpecError, chosen_name

DEFAULT_PARAMETERS = {"type": "object", "properties": {}}


def tool_call_grammar(tools: list[dict], tool_choice, parallel_tool_calls: bool, parser: ToolParser) -> str | None:
    """EBNF that admits exactly a call (or, with parallel_tool_calls, calls apart by the
    parser's call_separator) of any
    tool for "required", of the named tool for a named choice; None when the model may choose.
    The JSON is compact with no free whitespace, which a small model can repeat forever."""
    if tool_choice in (None, "auto", "none"):
        return None
    import xgrammar as xgr

    chosen = chosen_name(tool_choice)
    one_call = xgr.Grammar.union(*[_call_grammar(xgr, tool, index, parser) for index, tool in enumerate(tools)
                                   if chosen in (None, tool["function"]["name"])])
    if not parallel_tool_calls:
        return str(one_call)
    # The combinators have no repetition; from_ebnf renames the single call's root when the
    # new rule takes its place, and str() names the new rule root.
    separator = json.dumps(parser.call_separator)
    return str(xgr.Grammar.from_ebnf(f'{one_call}\ntool_calls ::= root ({separator} root)*\n',
                                     root_rule_name="tool_calls"))


def _call_grammar(xgr, tool: dict, index: int, parser: ToolParser):
    function = tool["function"]
    schema = {"type": "object", **(function.get("parameters") or DEFAULT_PARAMETERS)}
    try:
        arguments = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except RuntimeError as exc:
        raise ToolSpecError(f"the parameters of {function['name']!r} cannot be enforced: {exc}",
                            f"tools[{index}].function.parameters") from None
    return xgr.Grammar.concat(_literal(xgr, parser.call_opening(function["name"])), arguments,
                              _literal(xgr, parser.call_closing()))


def _literal(xgr, text: str):
    # A JSON string literal is a valid EBNF one: the same quotes and backslash escapes.
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")
