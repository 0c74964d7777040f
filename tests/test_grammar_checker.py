"""The frontend's grammar check: a deadline per compile, bounded compile threads, and
refusals that are remembered only when the spec itself was too slow."""

import asyncio
import threading
import time

import pytest

from engine.sampling_params import StructuredOutput
from frontend.edge_decoding import InvalidInput
from frontend.structured_output import MAX_COMPILING, GrammarBusy, GrammarChecker
from tests.tiny_models import build_tokenizer


@pytest.fixture
def checker():
    tokenizer = build_tokenizer()
    checker = GrammarChecker(tokenizer, len(tokenizer), deadline_s=0.3)
    release = threading.Event()
    real_compile = checker.compiler.compile
    # Specs starting with "slow" take until the test releases them.
    checker.compiler.compile = lambda spec: (spec.spec.startswith("slow") and release.wait(30), real_compile(spec))[1]
    yield checker, release
    release.set()


def regex(text: str) -> StructuredOutput:
    return StructuredOutput("regex", text)


async def test_slow_specs_are_refused_remembered_and_hold_their_slots(checker):
    checker, release = checker
    slow = [regex(f"slow{i}") for i in range(MAX_COMPILING)]
    for spec in slow:
        with pytest.raises(InvalidInput) as refused:
            await checker.check(spec, "guided_regex")
        assert refused.value.code == "grammar_too_complex"
    # Their threads still run: a new spec is told to retry, and that is not remembered.
    with pytest.raises(GrammarBusy):
        await checker.check(regex("[a-z]+"), "guided_regex")
    started = time.monotonic()
    with pytest.raises(InvalidInput):
        await checker.check(slow[0], "guided_regex")  # remembered: refused at once
    assert time.monotonic() - started < 0.1
    release.set()
    while checker._running:
        await asyncio.sleep(0.01)
    await checker.check(regex("[a-z]+"), "guided_regex")  # compiles now


async def test_a_bad_spec_is_a_400_naming_it(checker):
    checker, _ = checker
    with pytest.raises(InvalidInput) as refused:
        await checker.check(regex("a(b"), "guided_regex")
    assert refused.value.code == "invalid_grammar" and refused.value.param == "guided_regex"
    assert checker._running == 0
