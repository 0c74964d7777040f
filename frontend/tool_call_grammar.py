"""The grammar that forces a tool call when `tool_choice` is "required" or names a function.

It admits exactly the text the Hermes parser reads as calls (frontend/tool_parsers/
hermes_tool_parser.py), each call's arguments held to its tool's parameters schema, so a
forced answer always parses into calls. It is compiled and bounded like any client grammar
(frontend/structured_output.py, forced_call_grammar).
"""

from __future__ import annotations

import json

from frontend.tool_parsers.hermes_tool_parser import CLOSE_TAG, OPEN_TAG
from frontend.tool_specs import ToolSpecError, chosen_name

DEFAULT_PARAMETERS = {"type": "object", "properties": {}}


def tool_call_grammar(tools: list[dict], tool_choice, parallel_tool_calls: bool) -> str | None:
    """EBNF that admits exactly a call (or, with parallel_tool_calls, calls one per line) of any
    tool for "required", of the named tool for a named choice; None when the model may choose.
    The JSON is compact with no free whitespace, which a small model can repeat forever."""
    if tool_choice in (None, "auto", "none"):
        return None
    import xgrammar as xgr

    chosen = chosen_name(tool_choice)
    one_call = xgr.Grammar.union(*[_call_grammar(xgr, tool, index) for index, tool in enumerate(tools)
                                   if chosen in (None, tool["function"]["name"])])
    if not parallel_tool_calls:
        return str(one_call)
    # The combinators have no repetition; from_ebnf renames the single call's root when the
    # new rule takes its place, and str() names the new rule root.
    return str(xgr.Grammar.from_ebnf(f'{one_call}\ntool_calls ::= root ("\\n" root)*\n', root_rule_name="tool_calls"))


def _call_grammar(xgr, tool: dict, index: int):
    function = tool["function"]
    schema = {"type": "object", **(function.get("parameters") or DEFAULT_PARAMETERS)}
    try:
        arguments = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except RuntimeError as exc:
        raise ToolSpecError(f"the parameters of {function['name']!r} cannot be enforced: {exc}",
                            f"tools[{index}].function.parameters") from None
    opening = f'{OPEN_TAG}\n{{"name": {json.dumps(function["name"])}, "arguments": '
    return xgr.Grammar.concat(_literal(xgr, opening), arguments, _literal(xgr, "}\n" + CLOSE_TAG))


def _literal(xgr, text: str):
    # A JSON string literal is a valid EBNF one: the same quotes and backslash escapes.
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")
