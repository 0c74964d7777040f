"""What the front end's grammar check costs (frontend/structured_output.py GrammarChecker,
compiles in frontend/grammar_workers.py): the compile server's cold start (the first check),
a new small schema's check, a known one's, the check right after a compile was killed at its
deadline (its replacement is forked first), and the processes' memory. With --handover:
what handing a compiled grammar to the decoder would cost instead of compiling it there
(xgrammar's JSON serialization: its size, writing and reading it, against the compile).

    python benchmarks/grammar_checker.py            # the default model's tokenizer
    python benchmarks/grammar_checker.py --tiny     # the tests' 384-token tokenizer
    python benchmarks/grammar_checker.py --handover
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampling_params import StructuredOutput  # noqa: E402
from frontend.edge_decoding import InvalidInput  # noqa: E402
from frontend.structured_output import GrammarChecker  # noqa: E402
from frontend.tenancy import FairShare  # noqa: E402

SLOW = StructuredOutput("json_schema", json.dumps(
    {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 20 + 7 * i} for i in range(60)}}))


def small_schema(i: int) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps({
        "type": "object", "required": ["name", "age"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150 + i}}}))


def tokenizer_of(tiny: bool):
    if tiny:
        from tests.tiny_models import build_tokenizer

        return build_tokenizer()
    from engine.checkpoint import ensure_default_model, load_tokenizer

    return load_tokenizer(ensure_default_model())


async def timed(checker, spec) -> float:
    started = time.perf_counter()
    try:
        await checker.check(spec, "guided_json")
    except InvalidInput:
        pass
    return time.perf_counter() - started


async def main(tiny: bool, runs: int) -> None:
    tokenizer = tokenizer_of(tiny)
    print(f"tokenizer: {len(tokenizer)} tokens; {psutil.cpu_count()} CPUs")
    # One worker, so the check after a kill waits for the fork that replaces it.
    checker = GrammarChecker(tokenizer, len(tokenizer), deadline_s=0.5,
                             shares=FairShare("grammar compiles", "--max-grammar-compiles", 1, 1, 1))
    try:
        print(f"cold start (the first check): {await timed(checker, small_schema(-1)):.2f} s")
        new = [await timed(checker, small_schema(i)) for i in range(runs)]
        print(f"new small schema: median {statistics.median(new) * 1e3:.1f} ms, max {max(new) * 1e3:.1f} ms")
        known = [await timed(checker, small_schema(0)) for _ in range(runs)]
        print(f"known schema: median {statistics.median(known) * 1e6:.0f} us")
        after = []
        for i in range(min(runs, 5)):
            await timed(checker, StructuredOutput("json_schema", SLOW.spec.replace("p0", f"x{i}")))
            after.append(await timed(checker, small_schema(1000 + i)))
        print(f"new small schema right after a kill at the deadline: median {statistics.median(after) * 1e3:.1f} ms")
        server = psutil.Process(checker.workers.server_pid)
        memory = [process.memory_full_info() for process in [server, *server.children()]]
        print(f"memory: {sum(m.pss for m in memory) / 2**20:.0f} MiB PSS in all; private (USS): compile server "
              f"{memory[0].uss / 2**20:.0f} MiB, workers {', '.join(f'{m.uss / 2**20:.0f}' for m in memory[1:])} MiB")
    finally:
        await checker.close()


def handover(tiny: bool) -> None:
    import xgrammar

    tokenizer = tokenizer_of(tiny)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    for name, schema in [("small schema", json.loads(small_schema(0).spec))] + [
            (f"{n} strings of distinct maxLength", {"type": "object", "properties": {
                f"p{i}": {"type": "string", "maxLength": 20 + 7 * i} for i in range(n)}}) for n in (3, 6)]:
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        compiled_at = time.perf_counter()
        text = compiled.serialize_json()
        written = time.perf_counter()
        xgrammar.CompiledGrammar.deserialize_json(text, info)
        read = time.perf_counter()
        print(f"{name}: compile {compiled_at - started:.3f} s; serialized {len(text) / 1e6:.1f} MB "
              f"({compiled.memory_size_bytes / 1e6:.1f} MB in memory), written in {written - compiled_at:.3f} s, "
              f"read in {read - written:.3f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tests' 384-token tokenizer")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--handover", action="store_true", help="the cost of serialized compiled grammars")
    args = parser.parse_args()
    if args.handover:
        handover(args.tiny)
    else:
        asyncio.run(main(args.tiny, args.runs))
