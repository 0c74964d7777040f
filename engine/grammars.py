"""Structured output: what an answer must match, compiled into a token-level grammar.

One grammar engine, xgrammar, for every kind of constraint (JSON, a JSON schema, a regex, a
list of choices, an EBNF grammar). Measured on the default model's 49k vocabulary, 2 cores
(`python benchmarks/structured_output.py --engines`): xgrammar compiles a small schema in
~5-6 ms (2 us when cached) and fills a token mask in ~3-4 us on average (p99 ~20 us);
llguidance sets a schema up in ~1 ms but fills a mask in ~18-28 us (p99 ~180 us, up to
~2.5 ms). The mask is filled for every constrained request on every step, so the per-token
cost decides.

The frontend compiles a spec once to refuse a bad one with a 400 before the request is
admitted (in a process a deadline can kill: frontend/grammar_workers.py); the decoder compiles
it again (cached by spec) while the request's prompt is prefilled, and keeps one matcher per
request. Handing the front end's compiled grammar over instead is left out: xgrammar's only
portable form is JSON, 2-20x the grammar's size (megabytes for a slow schema, to carry per
request), written in about a third of a compile and read in a sixth on the default model's
vocabulary, and both far slower than compiling on small vocabularies
(`python benchmarks/grammar_checker.py --handover [--tiny]`).

A grammar that can match no text at all (a rule or `$ref` that only leads back to itself) is
a GrammarError like one that does not parse: a matcher for it could never end.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from engine.sampling_params import StructuredOutput

# Compiles the decoder remembers, per cache salt and spec, bounded by count and by the
# compiled grammars' bytes (a preempted request finds its grammar again; a repeated spec is
# not compiled again). xgrammar's own cache is off: it is keyed by the grammar alone, so one
# tenant's compile would answer another's quickly and tell it what the first asked for.
GRAMMAR_CACHE_BYTES = 256 << 20
RECENT_COMPILES = 64
# Compiles at once in the decoder: as many as the frontend lets through (one slow grammar
# does not queue every other behind it).
COMPILE_THREADS = 2

# xgrammar's errors start with "[time] /path/file.cc:line: "; the client needs the rest.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")


class GrammarError(ValueError):
    """A spec the grammar engine cannot compile; the message says why."""


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; thread-safe, cached by spec.

    `load_tokenizer` is called on first use: a server that never sees a constrained request
    never pays for building the tokenizer's grammar tables (~0.15 s)."""

    def __init__(self, load_tokenizer, vocab_size: int, threads: int = 1,
                 cache_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._threads = threads
        # 0: nothing remembered (a caller that remembers outcomes itself).
        self._cache_bytes = cache_bytes
        self._compiler = None
        self._lock = threading.Lock()
        self._tables_lock = threading.Lock()
        # Compiles run here, never on a step's thread: a slow grammar delays only the
        # requests that wait for it.
        self._compiling = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._recent: OrderedDict[StructuredOutput, Future] = OrderedDict()

    def _xgrammar_compiler(self):
        with self._tables_lock:
            if self._compiler is None:
                import xgrammar

                # Stop tokens come with each matcher: a request ends on its own EOS ids.
                info = xgrammar.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False)
            return self._compiler

    def build_tables(self) -> None:
        """Builds the tokenizer's grammar tables now rather than at the first compile."""
        self._xgrammar_compiler()

    def submit(self, spec: StructuredOutput, cache_salt: str | None = None) -> Future:
        """The compiled grammar, later (its exception: GrammarError). Requests of one cache
        salt (tenant) share compiles; another salt's same spec is compiled for it anew."""
        key = (cache_salt, spec)
        with self._lock:
            future = self._recent.get(key)
            if future is None:
                future = self._recent[key] = self._compiling.submit(self.compile, spec)
                self._forget_past_bounds()
            else:
                self._recent.move_to_end(key)
            return future

    def _forget_past_bounds(self) -> None:
        """Oldest first, past RECENT_COMPILES or the byte budget (a request holding a
        forgotten compile keeps it; only later requests compile again)."""
        sizes = [_bytes_of(future) for future in self._recent.values()]
        total = sum(sizes)
        for size in sizes[:-1]:
            if len(self._recent) <= RECENT_COMPILES and total <= self._cache_bytes:
                break
            self._recent.popitem(last=False)
            total -= size

    def close(self) -> None:
        self._compiling.shutdown(wait=False, cancel_futures=True)

    def compile(self, spec: StructuredOutput):
        """The compiled grammar (an xgrammar CompiledGrammar); raises GrammarError, also for
        a grammar that can match no text."""
        name = _KIND_NAMES[spec.kind]
        try:
            compiler = self._xgrammar_compiler()
            grammar = _grammar_of(spec)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, MemoryError...
            raise GrammarError(f"cannot compile the {name}: {_clean(exc)}") from None
        # Before the compile, which is the costly part: an empty language is refused for free.
        endless = _rule_that_never_ends(grammar)
        if endless is not None:
            raise GrammarError(f"the {name} can match no text: its rule {endless!r} never completes (a rule or $ref "
                               "that only leads back to itself, or a character class that admits nothing)")
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(f"cannot compile the {name}: {_clean(exc)}") from None
        if not _can_start(compiled):
            raise GrammarError(f"the {name} can match no text: no token of this model can start it")
        return compiled

    def matcher(self, compiled, stop_token_ids: list[int]):
        """A fresh matcher that ends on the request's own stop tokens."""
        import xgrammar

        return xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)


def _bytes_of(future: Future) -> int:
    """A compiled grammar's memory; 0 while it compiles or if it failed."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return 0
    return future.result().memory_size_bytes


def _grammar_of(spec: StructuredOutput):
    """The spec as an xgrammar Grammar, not yet compiled."""
    import xgrammar

    if spec.kind == "json_object":
        return xgrammar.Grammar.builtin_json_grammar()
    if spec.kind == "json_schema":
        # No free whitespace: a small model can loop on newlines forever inside an object;
        # the answer is compact JSON, still valid.
        return xgrammar.Grammar.from_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.spec)
    if spec.kind == "choice":
        return xgrammar.Grammar.from_ebnf(choice_grammar(json.loads(spec.spec)))
    return xgrammar.Grammar.from_ebnf(spec.spec)


# The layout of xgrammar's serialized Grammar that _rule_that_never_ends reads: expression
# types by number (cpp/grammar_impl.h, GrammarExprType) and the format version they hold for.
_GRAMMAR_FORMAT = "v16"
_BYTES, _CHAR_CLASS, _CHAR_CLASS_STAR, _EMPTY, _RULE, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)
_LAST_CODE_POINT = 0x10FFFF


def _rule_that_never_ends(grammar) -> str | None:
    """The root rule's name if no finite text derives from it (the grammar's language is
    empty), else None. Productive rules are found as for any context-free grammar: a rule is
    productive once one of its alternatives is made only of text and productive rules.
    Lookahead assertions are ignored, and so are expression types this does not know (they
    count as productive): either can only make a grammar look satisfiable, so what is
    refused is always truly empty. A serialized layout other than the known one is not read."""
    data = msgspec.json.decode(grammar.serialize_json())
    if data.get("__VERSION__") != _GRAMMAR_FORMAT:
        return None
    rules, values, starts = data["rules"], data["grammar_expr_data"], data["grammar_expr_indptr"]

    def expr(expr_id: int) -> tuple[int, list[int]]:
        start = starts[expr_id]
        return values[start], values[start + 2:start + 2 + values[start + 1]]

    def refs(expr_id: int, into: set[int]) -> set[int]:
        kind, args = expr(expr_id)
        if kind in (_RULE, _REPEAT):
            into.add(args[0])
        elif kind in (_SEQUENCE, _CHOICES):
            for arg in args:
                refs(arg, into)
        return into

    productive = [False] * len(rules)

    def derives_text(expr_id: int) -> bool:
        kind, args = expr(expr_id)
        if kind == _RULE:
            return productive[args[0]]
        if kind == _REPEAT:
            return args[1] == 0 or productive[args[0]]
        if kind == _SEQUENCE:
            return all(derives_text(arg) for arg in args)
        if kind == _CHOICES:
            return any(derives_text(arg) for arg in args)
        if kind == _CHAR_CLASS:
            return _char_class_admits_some(args[0] != 0, args[1:])
        return True  # bytes, a class star, the empty string, a tag dispatch, anything newer

    referrers: list[list[int]] = [[] for _ in rules]
    for rule_id, rule in enumerate(rules):
        for used in refs(rule[1], set()):
            referrers[used].append(rule_id)
    pending = deque(range(len(rules)))
    while pending:
        rule_id = pending.popleft()
        if not productive[rule_id] and derives_text(rules[rule_id][1]):
            productive[rule_id] = True
            pending.extend(referrers[rule_id])
    root = data["root_rule_id"]
    return None if productive[root] else rules[root][0]


def _char_class_admits_some(negated: bool, bounds: list[int]) -> bool:
    ranges = sorted(zip(bounds[::2], bounds[1::2]))
    if not negated:
        return any(low <= high for low, high in ranges)
    covered = -1  # every code point up to here is excluded
    for low, high in ranges:
        if low > covered + 1:
            return True
        covered = max(covered, high)
    return covered < _LAST_CODE_POINT


def _can_start(compiled) -> bool:
    """Whether some token can begin the text, or the grammar is already complete (only the
    empty text matches: the answer is a stop token)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    if matcher.is_completed():
        return True
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar admitting exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


_KIND_NAMES = {"json_object": "JSON grammar", "json_schema": "JSON schema", "regex": "regex",
               "choice": "choice list", "grammar": "grammar"}


def _clean(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc).strip()).strip()
