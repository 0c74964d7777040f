"""Structured output: what an answer must match, compiled into a token-level grammar.

One grammar engine, xgrammar, for every kind of constraint (JSON, a JSON schema, a regex, a
list of choices, an EBNF grammar). Measured on the default model's 49k vocabulary, 2 cores
(`python benchmarks/structured_output.py --engines`): xgrammar compiles a small schema in
~5-6 ms (2 us when cached) and fills a token mask in ~3-4 us on average (p99 ~20 us);
llguidance sets a schema up in ~1 ms but fills a mask in ~18-28 us (p99 ~180 us, up to
~2.5 ms). The mask is filled for every constrained request on every step, so the per-token
cost decides.

The frontend compiles a spec once to refuse a bad one with a 400 before the request is
admitted; the decoder compiles it again (both cache by spec) while the request's prompt is
prefilled, and keeps one matcher per request.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from engine.sampling_params import StructuredOutput

# Compiled grammars kept per process (xgrammar's own cache, bounded by bytes), and the
# compile futures the decoder remembers (a preempted request finds its grammar again).
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

    def __init__(self, load_tokenizer, vocab_size: int, threads: int = 1) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._threads = threads
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
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._threads,
                                                          cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler

    def submit(self, spec: StructuredOutput) -> Future:
        """The compiled grammar, later (its exception: GrammarError)."""
        with self._lock:
            future = self._recent.get(spec)
            if future is None:
                future = self._recent[spec] = self._compiling.submit(self.compile, spec)
                if len(self._recent) > RECENT_COMPILES:
                    self._recent.popitem(last=False)
            else:
                self._recent.move_to_end(spec)
            return future

    def close(self) -> None:
        self._compiling.shutdown(wait=False, cancel_futures=True)

    def compile(self, spec: StructuredOutput):
        """The compiled grammar (an xgrammar CompiledGrammar); raises GrammarError."""
        try:
            compiler = self._xgrammar_compiler()
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "json_schema":
                # No free whitespace: a small model can loop on newlines forever inside an
                # object; the answer is compact JSON, still valid.
                return compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec.spec)))
            return compiler.compile_grammar(spec.spec)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, MemoryError...
            raise GrammarError(f"cannot compile the {_KIND_NAMES[spec.kind]}: {_clean(exc)}") from None

    def matcher(self, compiled, stop_token_ids: list[int]):
        """A fresh matcher that ends on the request's own stop tokens."""
        import xgrammar

        return xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar admitting exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


_KIND_NAMES = {"json_object": "JSON grammar", "json_schema": "JSON schema", "regex": "regex",
               "choice": "choice list", "grammar": "grammar"}


def _clean(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc).strip()).strip()
