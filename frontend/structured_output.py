"""Structured output at the edge: the request's constraint as one StructuredOutput, checked.

Sources, at most one per request: OpenAI's `response_format` (`json_object`, `json_schema`)
and vLLM's extensions `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Tool calls that must happen (`tool_choice` "required" or a named function) bring their own
grammar (frontend/tool_calls.py). Each spec is compiled here once, in a worker thread, so a
schema the grammar engine cannot compile is a 400 naming the problem before the request is
admitted; specs that compiled are remembered so the next request skips the thread hop.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Annotated, Literal

import anyio
import msgspec

from engine.grammars import GrammarCompiler, GrammarError
from engine.sampling_params import StructuredOutput
from frontend.edge_decoding import InvalidInput

# Specs known to compile, remembered per frontend (keys only: the decoder keeps the grammars).
KNOWN_GOOD_SPECS = 4096


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(max_length=64)] = "response"
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def structured_output_of(response_format: ResponseFormat | None = None, guided_json=None,
                         guided_regex: str | None = None, guided_choice: list[str] | None = None,
                         guided_grammar: str | None = None,
                         max_bytes: int = 64 << 10) -> tuple[StructuredOutput, str] | None:
    """The one constraint a request asks for and the field that asked (None: free text);
    InvalidInput for two, or for a bad one."""
    given = {name: value for name, value in (("response_format", response_format), ("guided_json", guided_json),
                                             ("guided_regex", guided_regex), ("guided_choice", guided_choice),
                                             ("guided_grammar", guided_grammar))
             if value is not None and not (name == "response_format" and value.type == "text")}
    if len(given) > 1:
        raise InvalidInput(f"give one of {', '.join(given)}, not several", "invalid_value", list(given)[1])
    if not given:
        return None
    (param, value), = given.items()
    if param == "response_format":
        if value.type == "json_object":
            return StructuredOutput("json_object"), param
        if value.json_schema is None or value.json_schema.schema is None:
            raise InvalidInput('response_format type "json_schema" needs json_schema.schema', "invalid_value",
                               "response_format.json_schema")
        spec = StructuredOutput("json_schema", json.dumps(value.json_schema.schema))
    elif param == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidInput("guided_json must be a JSON schema (an object, or its JSON text)",
                                   "invalid_value", param) from None
        if not isinstance(value, dict):
            raise InvalidInput("guided_json must be a JSON schema object", "invalid_value", param)
        spec = StructuredOutput("json_schema", json.dumps(value))
    elif param == "guided_choice":
        if not value or not all(isinstance(choice, str) and choice for choice in value):
            raise InvalidInput("guided_choice must be a list of non-empty strings", "invalid_value", param)
        spec = StructuredOutput("choice", json.dumps(value))
    else:
        if not value:
            raise InvalidInput(f"{param} must not be empty", "invalid_value", param)
        spec = StructuredOutput("regex" if param == "guided_regex" else "grammar", value)
    if len(spec.spec.encode()) > max_bytes:
        raise InvalidInput(f"{param} is over {max_bytes} bytes (--max-grammar-bytes)", "invalid_value", param)
    return spec, param


class GrammarChecker:
    """Compiles specs off the event loop, one at a time (a flood of huge schemas takes one
    thread, not the pool), and remembers the ones that compiled."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.compiler = GrammarCompiler(lambda: tokenizer, vocab_size)
        self._limiter = anyio.CapacityLimiter(1)
        self._good: OrderedDict[StructuredOutput, None] = OrderedDict()

    async def check(self, spec: StructuredOutput, param: str) -> None:
        if spec in self._good:
            self._good.move_to_end(spec)
            return
        try:
            await anyio.to_thread.run_sync(self.compiler.compile, spec, limiter=self._limiter)
        except GrammarError as exc:
            raise InvalidInput(str(exc), "invalid_grammar", param) from None
        self._good[spec] = None
        if len(self._good) > KNOWN_GOOD_SPECS:
            self._good.popitem(last=False)
