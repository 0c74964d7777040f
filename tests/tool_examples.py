"""Tools, calls and the tokenizer the tool-calling tests share (test_tool_specs.py,
test_tool_parsers.py, test_tool_call_grammar.py)."""

import re

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def default_tokenizer():
    from engine.checkpoint import ensure_default_model, load_tokenizer

    return load_tokenizer(ensure_default_model())
