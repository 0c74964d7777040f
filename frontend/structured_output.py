"""Structured output at the edge: the request's constraint as one StructuredOutput, checked.

Sources, at most one per request: OpenAI's `response_format` (`json_object`, `json_schema`)
and vLLM's extensions `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Tool calls that must happen (`tool_choice` "required" or a named function) bring their own
grammar (frontend/tool_call_grammar.py). Each spec is compiled here once, in a process its deadline
can kill (frontend/grammar_workers.py), so a schema the grammar engine cannot compile, or that
can match no text, is a 400 naming the problem before the request is admitted; outcomes are
remembered by digest, so the next request with a known spec costs one hash.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Literal

import anyio
import msgspec

from engine.sampling_params import StructuredOutput
from frontend.edge_decoding import InvalidInput
from frontend.grammar_workers import GrammarWorkers, Outcome, WorkersUnavailable
from frontend.tenancy import ANONYMOUS, FairShare, Requester, ShareExhausted, share_of
from frontend.tool_call_grammar import tool_call_grammar
from frontend.tool_parsers import ToolParser
from frontend.tool_specs import ToolSpecError

# Specs' outcomes (compiled, refused and why) remembered per frontend by digest.
KNOWN_SPECS = 4096
# A client whose compile ran past its deadline may not take the last free slot for this many
# deadlines: long enough that retrying a fresh slow schema at once does not pay.
SLOW_COOLDOWN_DEADLINES = 6
# Compiles at once when no server config says otherwise (ServerConfig.max_grammar_compiles).
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
                              max_bytes: int, parser: ToolParser) -> StructuredOutput | None:
    """The grammar that forces a tool call ("required" or a named function), built off the
    loop (one JSON schema conversion per tool) and bounded like any client grammar."""
    # A named function is called once; "required" may call several unless told otherwise.
    parallel = tool_choice == "required" and parallel_tool_calls is not False
    try:
        grammar = await anyio.to_thread.run_sync(tool_call_grammar, tools, named_choice(tool_choice), parallel,
                                                 parser)
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
    """tool_choice as frontend/tool_specs.py takes it: a string, or a named function as a dict."""
    return msgspec.to_builtins(tool_choice) if tool_choice is not None and not isinstance(tool_choice, str) \
        else tool_choice


@dataclass(frozen=True)
class Refusal:
    code: str  # "invalid_grammar" or "grammar_too_complex"
    message: str


class SharedCompile:
    """One spec's compile and the requests waiting for it. When the last of them goes (its
    task cancelled: the client left), the compile is cancelled, which kills its process."""

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.waiting = 0
        self.stopped = False

    async def outcome(self) -> Refusal | None:
        self.waiting += 1
        try:
            return await asyncio.shield(self.task)
        finally:
            self.waiting -= 1
            if not self.waiting and not self.task.done():
                self.stopped = True
                self.task.cancel()


class GrammarChecker:
    """Compiles specs in killable worker processes, each within a deadline counted from when
    a worker takes it, and remembers the outcome by digest.

    Compiles in flight are bounded server-wide, per tenant and per client (a FairShare whose
    total is also the number of worker processes): past a share a new spec is refused at once
    as busy (429, not remembered), naming whose share is full. Requests that ask for the same
    spec at once share its one compile. A compile past its deadline, or that nobody waits for
    any more, is stopped with its process: its slot and its core are free again at once."""

    def __init__(self, tokenizer, vocab_size: int, deadline_s: float = 10.0, shares: FairShare | None = None,
                 per_tenant: bool = False) -> None:
        self.deadline_s = deadline_s
        # Outcomes remembered per tenant: a spec another key compiled must not answer faster
        # (a known spec takes microseconds, a new one a compile), or a tenant could test what
        # schemas the others use.
        self.per_tenant = per_tenant
        self.shares = shares if shares is not None else \
            FairShare("grammar compiles", "--max-grammar-compiles", MAX_COMPILING, MAX_COMPILING, MAX_COMPILING)
        self.workers = GrammarWorkers(tokenizer, vocab_size, self.shares.total)
        # digest -> None (compiled) or why it is refused.
        self._known: OrderedDict[bytes, Refusal | None] = OrderedDict()
        self._compiling: dict[bytes, SharedCompile] = {}
        # Clients and tenants whose compile ran past its deadline lately, until when: they may
        # not take the last free slot, so two clients sending fresh slow schemas cannot hold
        # every slot between them (oldest first; all wait the same, so expiry is in order).
        self._slow_until: OrderedDict[str, float] = OrderedDict()

    @classmethod
    def for_server(cls, config, tokenizer, vocab_size: int) -> "GrammarChecker":
        total = config.max_grammar_compiles
        # With one key (or none) every client is the same tenant: only the client share applies.
        per_tenant = share_of(total, config.share_per_tenant) if config.counts_tenants() else total
        shares = FairShare("grammar compiles", "--max-grammar-compiles", total, per_tenant,
                           share_of(total, config.share_per_client))
        return cls(tokenizer, vocab_size, config.grammar_compile_timeout_s, shares, per_tenant=config.salts_per_key())

    async def check(self, spec: StructuredOutput, param: str, requester: Requester = ANONYMOUS) -> None:
        tenant = requester.tenant if self.per_tenant else ""
        key = hashlib.sha256(f"{tenant}\0{spec.kind}\0{spec.spec}".encode()).digest()
        if key in self._known:
            self._known.move_to_end(key)
            refusal = self._known[key]
        else:
            compiling = self._compiling.get(key)
            if compiling is None or compiling.stopped:
                self._refuse_last_slot_to_slow(requester)
                try:
                    slot = self.shares.take(requester)
                except ShareExhausted as exc:
                    raise GrammarBusy(str(exc)) from None
                compiling = self._compiling[key] = SharedCompile(asyncio.create_task(
                    self._compile(key, spec, requester)))
                # Released when the compile ends however it ends, even cancelled before it ran.
                compiling.task.add_done_callback(lambda _: (slot.release(), self._ended(key, compiling)))
            refusal = await compiling.outcome()
        if refusal is not None:
            message = refusal.message if refusal.code == "invalid_grammar" else f"the {param} {refusal.message}"
            raise InvalidInput(message, refusal.code, param)

    async def _compile(self, key: bytes, spec: StructuredOutput, requester: Requester) -> Refusal | None:
        try:
            outcome = await self.workers.compile(spec, self.deadline_s)
        except WorkersUnavailable as exc:
            raise GrammarBusy(f"structured output is unavailable for a moment ({exc}); retry shortly") from None
        if outcome.refusal == "timeout":
            self._mark_slow(requester)
        refusal = _refusal_of(outcome, self.deadline_s)
        # A worker that died on a spec is not held against the spec: it may have died of
        # something else (the kernel's OOM killer, a signal).
        if outcome.refusal != "failed":
            self._known[key] = refusal
            if len(self._known) > KNOWN_SPECS:
                self._known.popitem(last=False)
        return refusal

    def _slow_names(self, requester: Requester) -> list[str]:
        return [name for name in (f"client:{requester.client}" if requester.client else "",
                                  f"tenant:{requester.tenant}" if requester.tenant else "") if name]

    def _mark_slow(self, requester: Requester) -> None:
        now = time.monotonic()
        while self._slow_until and next(iter(self._slow_until.values())) <= now:
            self._slow_until.popitem(last=False)
        for name in self._slow_names(requester):
            self._slow_until.pop(name, None)
            self._slow_until[name] = now + SLOW_COOLDOWN_DEADLINES * self.deadline_s
        while len(self._slow_until) > KNOWN_SPECS:
            self._slow_until.popitem(last=False)

    def _refuse_last_slot_to_slow(self, requester: Requester) -> None:
        if self.shares.held < self.shares.total - 1:
            return
        now = time.monotonic()
        if any(self._slow_until.get(name, 0.0) > now for name in self._slow_names(requester)):
            raise GrammarBusy("a schema from this client (or API key) did not compile within its deadline lately: "
                              "until that passes it may not take the last free compile slot; try again shortly")

    def _ended(self, key: bytes, compiling: SharedCompile) -> None:
        if self._compiling.get(key) is compiling:
            del self._compiling[key]

    @property
    def compiling(self) -> int:
        """Compiles in flight (each holds a share slot and a worker process)."""
        return self.shares.held

    def start_soon(self) -> None:
        self.workers.start_soon()

    async def close(self) -> None:
        await self.workers.close()


def _refusal_of(outcome: Outcome, deadline_s: float) -> Refusal | None:
    if outcome.refusal is None:
        return None
    if outcome.refusal == "invalid":
        return Refusal("invalid_grammar", outcome.message)
    if outcome.refusal == "timeout":
        return Refusal("grammar_too_complex", f"did not compile within {deadline_s:g} s; simplify it (fewer rules, "
                                              "no maxLength)")
    return Refusal("grammar_too_complex", f"could not be compiled: {outcome.message}")


class GrammarBusy(Exception):
    """A share of the compile slots is full (or the compile server is restarting): the client
    should retry (429); the message says whose share."""
