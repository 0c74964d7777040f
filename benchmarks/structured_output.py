"""What structured output costs: serving throughput with a JSON schema on every request
against none, in one run, and what compiling a schema takes.

    python benchmarks/structured_output.py              # starts its own server (default model)
    python benchmarks/structured_output.py --engines    # also xgrammar against llguidance
    python benchmarks/structured_output.py --url http://127.0.0.1:8000 --json out.json

Serving: benchmarks/serve.py's workload (its conversations, output budgets and closed-loop
streaming clients with ignore_eos, so every request produces exactly its budget), once plain
and once with `response_format` json_schema, over --rounds. Each round runs both modes on
fresh conversations with the same output budgets, and flips which goes first, since this
machine's speed drifts by 10-20% over minutes. The schema asks for a list of strings without
maxItems, so the JSON usually stays open until the budget and most tokens are constrained.
On a quiet 2-core machine one 30 s run differs from the next of the same mode by up to 10%:
two rounds (~3 min in all) tell a 10% cost from none; a few percent needs --rounds 6 (~6 min).
With ignore_eos no answer stops on its own, so a last untimed batch without it counts how
many answers stop and parse.

Compiling: engine/grammars.py's GrammarCompiler in this process, on the default model's
tokenizer: the tokenizer tables (once per process), then each schema cold and cached.
`--engines` also walks a valid answer to each schema token by token and times one token
mask per step in xgrammar and in llguidance (not a dependency: `pip install llguidance`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.http_client import RequestResult  # noqa: E402
from benchmarks.serve import chat_body as serve_chat_body  # noqa: E402
from benchmarks.serve import make_conversations, output_lengths, run_clients, start_server, summarize  # noqa: E402

VOCAB_SIZE = 49152  # the default model's

# Realistic schemas, each with a valid answer in the compact form the server's grammar
# admits (", " and ": " separators, no other whitespace). No maxLength: xgrammar 0.2.8
# compiles it slowly and lets control characters into the string.
SCHEMAS: dict[str, tuple[dict, dict]] = {
    "facts": (
        {"type": "object", "additionalProperties": False, "required": ["title", "facts"],
         "properties": {"title": {"type": "string"}, "facts": {"type": "array", "items": {"type": "string"}}}},
        {"title": "The lighthouse keeper", "facts": ["Keepers lived at the light for weeks at a time.",
                                                     "They trimmed the wick every few hours at night.",
                                                     "Many kept a logbook of the ships that passed."]},
    ),
    "profile": (
        {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "active"],
         "properties": {
             "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
             "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9.]+\\.[a-z]+$"},
             "role": {"enum": ["admin", "editor", "viewer"]}, "active": {"type": "boolean"},
             "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                         "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                        "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "editor", "active": True,
         "address": {"street": "12 St James's Square", "city": "London", "postcode": "10115"}},
    ),
    "product": (
        {"type": "object", "additionalProperties": False,
         "required": ["sku", "name", "price", "currency", "in_stock", "variants"],
         "properties": {
             "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "name": {"type": "string"},
             "price": {"type": "number", "minimum": 0}, "currency": {"enum": ["EUR", "USD", "GBP"]},
             "in_stock": {"type": "boolean"},
             "variants": {"type": "array", "minItems": 1, "items": {
                 "type": "object", "additionalProperties": False, "required": ["color", "size", "quantity"],
                 "properties": {"color": {"type": "string"}, "size": {"enum": ["S", "M", "L", "XL"]},
                                "quantity": {"type": "integer", "minimum": 0}}}}}},
        {"sku": "TSH-0042", "name": "Organic cotton T-shirt", "price": 24.5, "currency": "EUR", "in_stock": True,
         "variants": [{"color": "navy", "size": "M", "quantity": 12}, {"color": "white", "size": "XL", "quantity": 0}]},
    ),
    "tool_call": (
        {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": "get_weather"}, "arguments": {
                 "type": "object", "additionalProperties": False, "required": ["city", "unit"],
                 "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
            {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": "search_flights"}, "arguments": {
                 "type": "object", "additionalProperties": False, "required": ["origin", "destination", "date"],
                 "properties": {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                "passengers": {"type": "integer", "minimum": 1, "maximum": 9}}}}}]},
        {"name": "search_flights", "arguments": {"origin": "CDG", "destination": "JFK", "date": "2026-03-14",
                                                 "passengers": 2}},
    ),
    "event": (
        {"type": "object", "additionalProperties": False,
         "required": ["title", "date", "start", "duration_minutes", "organizer", "attendees"],
         "$defs": {"person": {"type": "object", "additionalProperties": False, "required": ["name"],
                              "properties": {"name": {"type": "string"}, "email": {"type": "string"}}}},
         "properties": {
             "title": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
             "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
             "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
             "organizer": {"$ref": "#/$defs/person"},
             "attendees": {"type": "array", "items": {"$ref": "#/$defs/person"}},
             "recurring": {"type": "boolean"}}},
        {"title": "Quarterly planning", "date": "2026-01-12", "start": "09:30", "duration_minutes": 90,
         "organizer": {"name": "Grace Hopper", "email": "grace@example.org"},
         "attendees": [{"name": "Alan Turing"}, {"name": "Katherine Johnson", "email": "kj@example.org"}],
         "recurring": False},
    ),
}
WORKLOAD_SCHEMA = "facts"


# --- serving ---------------------------------------------------------------------------

def chat_body(conversation: list[dict], max_tokens: int, schema: dict | None, ignore_eos: bool = True) -> dict:
    """serve.py's request, constrained to `schema` when there is one."""
    extra = {"ignore_eos": ignore_eos}
    if schema is not None:
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    return serve_chat_body(conversation, max_tokens, **extra)


def leading_json(text: str):
    """The JSON value an answer starts with, None while it is still open (an ignore_eos
    answer goes on past it with the stop tokens it ignores)."""
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        return None


def schema_validator(schema: dict):
    """jsonschema's check when it is installed (a test dependency), else None."""
    try:
        import jsonschema
    except ImportError:
        return None
    return jsonschema.Draft202012Validator(schema).is_valid


def check_answers(answers: list[RequestResult], schema: dict) -> dict:
    """How the schema answers ended: finish reasons, JSON closed within the budget, valid."""
    is_valid = schema_validator(schema)
    counts = {"answers": len(answers), "stopped": 0, "json_closed": 0, "json_valid": 0,
              "stopped_and_parsed": 0, "validated_with_jsonschema": is_valid is not None}
    for answer in answers:
        value = leading_json(answer.text)
        counts["stopped"] += answer.finish != "length"
        counts["json_closed"] += value is not None
        counts["json_valid"] += value is not None and (is_valid is None or is_valid(value))
        if answer.finish != "length":
            try:
                json.loads(answer.text)
                counts["stopped_and_parsed"] += 1
            except ValueError:
                pass
    return counts


def measure_serving(args: argparse.Namespace, url: str) -> dict:
    schema = SCHEMAS[WORKLOAD_SCHEMA][0]
    # Like serve.py, a warm-up first; here also one constrained request, so the schema's
    # compile (once per server, then cached) is not in the first timed round.
    warmup = make_conversations(2, 99, *args.prompt_words, label="Warm-up")
    asyncio.run(run_clients(url, [chat_body(warmup[0], 4, None), chat_body(warmup[1], 4, schema)], 2, args.api_key))
    runs = {"plain": [], "schema": []}
    schema_answers = []
    for round_index in range(args.rounds):
        budgets = output_lengths(args.num_requests, round_index, args.max_tokens, args.output_range_ratio)
        for mode in (("plain", "schema") if round_index % 2 == 0 else ("schema", "plain")):
            # Same prompt lengths for both modes; the label keeps any prefix from being shared.
            conversations = make_conversations(args.num_requests, round_index, *args.prompt_words,
                                               label=f"Round {round_index} {mode} request")
            bodies = [chat_body(c, n, schema if mode == "schema" else None) for c, n in zip(conversations, budgets)]
            results, elapsed = asyncio.run(run_clients(url, bodies, args.concurrency, args.api_key))
            errors = [r.error for r in results if r.error]
            if errors:
                raise RuntimeError(f"{len(errors)} {mode} requests failed, first: {errors[0]}")
            runs[mode].append(summarize(results, elapsed))
            schema_answers += results if mode == "schema" else []
            print(f"round {round_index} {mode}: {runs[mode][-1]['output_throughput']:.1f} output tok/s "
                  f"({elapsed:.1f} s)", flush=True)
    # Untimed: without ignore_eos, do the answers stop on their own, and parse?
    check = make_conversations(args.check_requests, 1000, *args.prompt_words, label="Check request")
    stopped, _ = asyncio.run(run_clients(
        url, [chat_body(c, args.check_max_tokens, schema, ignore_eos=False) for c in check],
        args.concurrency, args.api_key))
    plain = statistics.median(r["output_throughput"] for r in runs["plain"])
    constrained = statistics.median(r["output_throughput"] for r in runs["schema"])
    # Each round's two runs are minutes apart at most: their ratio is the least drift-prone.
    pair_ratios = [s["output_throughput"] / p["output_throughput"] for p, s in zip(runs["plain"], runs["schema"])]
    return {"rounds": runs, "plain_tok_s": plain, "schema_tok_s": constrained, "ratio": constrained / plain,
            "pair_ratios": pair_ratios,
            "tpot_p50_ms": {mode: 1000 * statistics.median(r["tpot"]["p50"] for r in runs[mode]) for mode in runs},
            "timed_answers": check_answers(schema_answers, schema),
            "check_answers": check_answers(stopped, schema), "check_max_tokens": args.check_max_tokens}


# --- compiling -------------------------------------------------------------------------

def timed(function, *args) -> tuple[float, object]:
    start = time.perf_counter()
    value = function(*args)
    return time.perf_counter() - start, value


def measure_compile(tokenizer, repeats: int, cached_repeats: int) -> dict:
    """Each repeat starts from a fresh GrammarCompiler, as a fresh server process does."""
    import xgrammar

    from engine.grammars import GrammarCompiler
    from engine.sampling_params import StructuredOutput

    specs = {name: StructuredOutput("json_schema", json.dumps(schema)) for name, (schema, _) in SCHEMAS.items()}
    tables, first, cold, cached = [], [], {name: [] for name in specs}, {name: [] for name in specs}
    for _ in range(repeats):
        # The tables alone, with the call GrammarCompiler makes on first use.
        tables.append(timed(lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE))[0])
        compiler = GrammarCompiler(lambda: tokenizer, VOCAB_SIZE)
        first.append(timed(compiler.compile, StructuredOutput("json_object"))[0])
        for name, spec in specs.items():
            cold[name].append(timed(compiler.compile, spec)[0])
        for name, spec in specs.items():
            cached[name] += [timed(compiler.compile, spec)[0] for _ in range(cached_repeats)]
    cold_ms = {name: 1000 * statistics.median(times) for name, times in cold.items()}
    cached_ms = {name: 1000 * statistics.median(times) for name, times in cached.items()}
    for name in specs:
        print(f"compile {name}: cold {cold_ms[name]:.1f} ms, cached {cached_ms[name] * 1000:.0f} us", flush=True)
    return {"tokenizer_tables_ms": 1000 * statistics.median(tables),
            "first_compile_ms": 1000 * statistics.median(first), "cold_ms": cold_ms, "cached_ms": cached_ms}


# --- xgrammar against llguidance -------------------------------------------------------

def walk_masks(fill, accept, tokens: list[int]) -> list[float]:
    """Seconds per mask fill along a valid answer; each token must be accepted."""
    seconds = []
    for position, token in enumerate(tokens):
        start = time.perf_counter()
        fill()
        seconds.append(time.perf_counter() - start)
        if not accept(token):
            raise RuntimeError(f"valid answer refused at token {position} ({token})")
    return seconds


def measure_engines(tokenizer, stop_ids: list[int], walks: int) -> dict | None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        print("llguidance is not installed (pip install llguidance): engine comparison skipped")
        return None
    import xgrammar

    from engine.grammars import GrammarCompiler
    from engine.sampling_params import StructuredOutput

    compiler = GrammarCompiler(lambda: tokenizer, VOCAB_SIZE)
    xgr_first = timed(compiler.compile, StructuredOutput("json_object"))[0]
    llg_tables, llg_tokenizer = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB_SIZE,
                                                                           eos_token=stop_ids))
    # The server's JSON form in both: no free whitespace, ", " and ": " separators.
    llg_options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    xgr_mask = xgrammar.allocate_token_bitmask(1, VOCAB_SIZE)
    llg_mask = llguidance.torch.allocate_token_bitmask(1, VOCAB_SIZE)
    per_schema, all_times = {}, {"xgrammar": [], "llguidance": []}
    for name, (schema, example) in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(example), add_special_tokens=False) + [stop_ids[0]]
        xgr_setup, compiled = timed(compiler.compile, StructuredOutput("json_schema", json.dumps(schema)))
        # Setup: what a new schema costs before its first mask. llguidance has no compile
        # step (it builds lazily, in the mask fills): the grammar text and a first matcher.
        llg_setup, grammar = timed(llguidance.LLMatcher.grammar_from_json_schema, schema, llg_options)
        error = llguidance.LLMatcher.validate_grammar(grammar, llg_tokenizer)
        if error:
            raise RuntimeError(f"llguidance refused {name}: {error}")
        xgr_times, llg_times = [], []
        for walk in range(walks):
            # A fresh matcher per walk, as each request gets one.
            seconds, matcher = timed(compiler.matcher, compiled, stop_ids)
            xgr_setup += seconds if walk == 0 else 0.0
            xgr_times += walk_masks(partial(matcher.fill_next_token_bitmask, xgr_mask, 0), matcher.accept_token, tokens)
            seconds, llg_matcher = timed(llguidance.LLMatcher, llg_tokenizer, grammar)
            llg_setup += seconds if walk == 0 else 0.0
            llg_times += walk_masks(partial(llguidance.torch.fill_next_token_bitmask, llg_matcher, llg_mask, 0),
                                    llg_matcher.consume_token, tokens)
        all_times["xgrammar"] += xgr_times
        all_times["llguidance"] += llg_times
        per_schema[name] = {"tokens": len(tokens), "xgrammar_setup_ms": 1000 * xgr_setup,
                            "llguidance_setup_ms": 1000 * llg_setup,
                            "xgrammar_mask_us": microseconds(xgr_times), "llguidance_mask_us": microseconds(llg_times)}
        print(f"engines {name} ({len(tokens)} tokens): setup xgrammar {1000 * xgr_setup:.1f} ms, llguidance "
              f"{1000 * llg_setup:.1f} ms; mask mean xgrammar {per_schema[name]['xgrammar_mask_us']['mean']:.0f} us, "
              f"llguidance {per_schema[name]['llguidance_mask_us']['mean']:.0f} us", flush=True)
    # Over every mask of every walk: a longer answer weighs more, as it does when serving.
    everything = {engine: microseconds(times) for engine, times in all_times.items()}
    return {"xgrammar_first_compile_ms": 1000 * xgr_first, "llguidance_tokenizer_ms": 1000 * llg_tables,
            "schemas": per_schema, "mask_us": everything}


def microseconds(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"mean": 1e6 * statistics.mean(ordered), "p99": 1e6 * ordered[int(0.99 * (len(ordered) - 1))],
            "max": 1e6 * ordered[-1]}


# --- report ----------------------------------------------------------------------------

def print_report(report: dict, args: argparse.Namespace) -> None:
    serving = report.get("serving")
    workload = (f" ({args.num_requests} requests x {args.rounds} rounds per mode, concurrency {args.concurrency}, "
                f"mean {args.max_tokens} output tokens)") if serving else ""
    print(f"\n| structured output{workload} | value |\n|---|---|")
    if serving:
        print(f"| output tok/s, plain (median of rounds) | {serving['plain_tok_s']:.1f} |")
        print(f"| output tok/s, JSON schema on every request | {serving['schema_tok_s']:.1f} |")
        print(f"| schema / plain | {serving['ratio']:.3f} (cost {100 * (1 - serving['ratio']):+.1f}%; "
              "target <= 5%) |")
        print(f"| schema / plain, each round | {' '.join(f'{r:.3f}' for r in serving['pair_ratios'])} |")
        print(f"| TPOT p50 ms, plain / schema | {serving['tpot_p50_ms']['plain']:.1f} / "
              f"{serving['tpot_p50_ms']['schema']:.1f} |")
        timed_answers, check = serving["timed_answers"], serving["check_answers"]
        valid = "valid" if timed_answers["validated_with_jsonschema"] else "parsed (jsonschema not installed)"
        print(f"| timed schema answers (ignore_eos): JSON closed within the budget / {valid} / total | "
              f"{timed_answers['json_closed']} / {timed_answers['json_valid']} / {timed_answers['answers']} |")
        print(f"| untimed, no ignore_eos, max {serving['check_max_tokens']} tokens: stopped / parsed / total | "
              f"{check['stopped']} / {check['stopped_and_parsed']} / {check['answers']} |")
    compiling = report["compile"]
    cold, cached = list(compiling["cold_ms"].values()), list(compiling["cached_ms"].values())
    print(f"| xgrammar tokenizer tables ms (once per process) | {compiling['tokenizer_tables_ms']:.0f} |")
    print(f"| first compile in a process ms (tables + builtin JSON grammar) | {compiling['first_compile_ms']:.0f} |")
    print(f"| cold compile ms, {len(cold)} schemas: median / max | {statistics.median(cold):.1f} / {max(cold):.1f} |")
    print(f"| cached compile us, {len(cached)} schemas: median / max | {1000 * statistics.median(cached):.0f} / "
          f"{1000 * max(cached):.0f} |")
    engines = report.get("engines")
    if engines:
        print(f"| llguidance tokenizer setup ms (once per process) | {engines['llguidance_tokenizer_ms']:.0f} |")
        for engine in ("xgrammar", "llguidance"):
            setups = [s[f"{engine}_setup_ms"] for s in engines["schemas"].values()]
            mask = engines["mask_us"][engine]
            print(f"| {engine}: per-schema setup ms median / max | {statistics.median(setups):.1f} / "
                  f"{max(setups):.1f} |")
            print(f"| {engine}: one token mask us, mean / p99 / max | {mask['mean']:.1f} / {mask['p99']:.0f} / "
                  f"{mask['max']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server; default: start one (default model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=48, help="per round and mode")
    parser.add_argument("--max-tokens", type=int, default=64, help="mean output tokens per request")
    parser.add_argument("--output-range-ratio", type=float, default=0.5,
                        help="output budgets are uniform in max_tokens * [1 - r, 1 + r]")
    parser.add_argument("--rounds", type=int, default=2, help="plain/schema pairs, alternating which goes first")
    parser.add_argument("--prompt-words", type=int, nargs=2, default=(40, 200))
    parser.add_argument("--check-requests", type=int, default=16,
                        help="untimed schema requests without ignore_eos, to count answers that stop and parse")
    parser.add_argument("--check-max-tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--compile-repeats", type=int, default=3, help="fresh compilers, for cold compile times")
    parser.add_argument("--engines", action="store_true", help="also compare xgrammar with llguidance")
    parser.add_argument("--walks", type=int, default=5, help="times each valid answer is walked per engine")
    parser.add_argument("--skip-serving", action="store_true", help="only the compile (and engine) numbers")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the numbers here")
    args = parser.parse_args()

    started = time.perf_counter()
    report: dict = {"args": vars(args)}
    if not args.skip_serving:
        process, url = None, args.url
        if url is None:
            process = start_server(None, args.port, ["--no-voice", "--max-num-seqs", str(args.concurrency),
                                                     "--max-waiting-requests", "1024"])
            url = f"http://127.0.0.1:{args.port}"
        try:
            report["serving"] = measure_serving(args, url)
        finally:
            if process is not None:
                process.terminate()
                process.wait()
    # After the server is gone: compiling and mask timings get the machine to themselves.
    from engine.checkpoint import ensure_default_model, eos_token_ids, load_tokenizer
    model_path = ensure_default_model()
    tokenizer = load_tokenizer(model_path)
    report["compile"] = measure_compile(tokenizer, args.compile_repeats, cached_repeats=20)
    if args.engines:
        report["engines"] = measure_engines(tokenizer, list(eos_token_ids(model_path, tokenizer)), args.walks)
    print_report(report, args)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
