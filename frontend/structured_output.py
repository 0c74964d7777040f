"""Structured output at the edge: the request's constraint as one StructuredOutput, checked.

Sources, at most one per request: OpenAI's `response_format` (`json_object`, `json_schema`)
and vLLM's extensions `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Tool calls that must happen (`tool_choice` "required" or a named function) bring their own
grammar (frontend/tool_calls.py). Each spec is compiled here once, in a worker thread, so a
schema the grammar engine cannot compile is a 400 naming the problem before the request is
admitted; specs that compiled are remembered so the next request skips the thread hop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import anyio
import msgspec

from engine.grammars import GrammarCompiler, GrammarError
from engine.sampling_params import StructuredOutput
from frontend.edge_decoding import InvalidInput
from frontend.tool_calls import ToolSpecError, tool_call_grammar

# Specs known to compile, and ones that took too long, remembered per frontend by digest.
KNOWN_SPECS = 4096
# Specs compiling at once in the frontend (each holds its thread until done, even past its
# deadline, when the same spec is then refused at once).
MAX_COMPILING = 2


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


async def forced_call_grammar(tools: list[dict], tool_choice, parallel_tool_calls: bool | None,
                              max_bytes: int) -> StructuredOutput | None:
    """The grammar that forces a tool call ("required" or a named function), built off the
    loop (one JSON schema conversion per tool) and bounded like any client grammar."""
    # A named function is called once; "required" may call several unless told otherwise.
    parallel = tool_choice == "required" and parallel_tool_calls is not False
    try:
        grammar = await anyio.to_thread.run_sync(tool_call_grammar, tools, named_choice(tool_choice), parallel)
    except ToolSpecError as exc:
        raise InvalidInput(str(exc), "invalid_value", exc.param) from None
    if grammar is None:
        return None
    if len(grammar.encode()) > max_bytes:
        raise InvalidInput(f"the grammar forcing this tool call is over {max_bytes} bytes (--max-grammar-bytes); "
                           "offer fewer or smaller tools", "invalid_value", "tools")
    return StructuredOutput("grammar", grammar)


def check_logit_bias(params, vocab_size: int) -> None:
    if any(token_id >= vocab_size for token_id in params.logit_bias):
        raise InvalidInput(f"logit_bias names a token id outside the vocabulary of {vocab_size}", "invalid_value",
                           "logit_bias")


def named_choice(tool_choice):
    """tool_choice as frontend/tool_calls.py takes it: a string, or a named function as a dict."""
    return msgspec.to_builtins(tool_choice) if tool_choice is not None and not isinstance(tool_choice, str) \
        else tool_choice


class GrammarChecker:
    """Compiles specs off the event loop, each within a deadline, and remembers the outcome
    by digest. At most MAX_COMPILING compiles run at once, each holding its slot until its
    thread really ends (xgrammar cannot be interrupted: a compile past its deadline finishes
    in the background). With every slot taken a new spec is refused at once as busy (429,
    not remembered); the deadline counts only the spec's own compile."""

    def __init__(self, tokenizer, vocab_size: int, deadline_s: float = 10.0) -> None:
        self.compiler = GrammarCompiler(lambda: tokenizer, vocab_size)
        self.deadline_s = deadline_s
        self._threads = ThreadPoolExecutor(MAX_COMPILING, thread_name_prefix="grammar-check")
        self._running = 0
        # digest -> None (compiled) or the refusal's message.
        self._known: OrderedDict[bytes, str | None] = OrderedDict()

    async def check(self, spec: StructuredOutput, param: str) -> None:
        key = hashlib.sha256(f"{spec.kind}\0{spec.spec}".encode()).digest()
        if key in self._known:
            self._known.move_to_end(key)
            if self._known[key] is not None:
                raise InvalidInput(self._known[key], "grammar_too_complex", param)
            return
        if self._running >= MAX_COMPILING:
            raise GrammarBusy("the server is compiling other grammars; retry in a moment")
        self._running += 1
        loop = asyncio.get_running_loop()
        compiling = self._threads.submit(self.compiler.compile, spec)
        compiling.add_done_callback(lambda _: loop.call_soon_threadsafe(self._compile_ended))
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiling)), self.deadline_s)
            outcome = None
        except GrammarError as exc:
            raise InvalidInput(str(exc), "invalid_grammar", param) from None
        except TimeoutError:
            outcome = (f"the {param} did not compile within {self.deadline_s:g} s; simplify it (fewer rules, "
                       "no maxLength)")
        self._known[key] = outcome
        if len(self._known) > KNOWN_SPECS:
            self._known.popitem(last=False)
        if outcome is not None:
            raise InvalidInput(outcome, "grammar_too_complex", param)

    def _compile_ended(self) -> None:
        self._running -= 1


class GrammarBusy(Exception):
    """Every compile slot is taken: the client should retry (429)."""
