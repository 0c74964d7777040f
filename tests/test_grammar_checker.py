"""The frontend's grammar check: compiles in worker processes that a deadline kills, fair
shares of them per client and per tenant, one compile for requests that ask for the same spec
at once, a compile nobody waits for any more stopped with its process, and a worker or the
compile server killed mid-compile."""

import asyncio
import json
import time

import psutil
import pytest
import pytest_asyncio

from engine.sampling_params import StructuredOutput
from frontend.edge_decoding import InvalidInput
from frontend.structured_output import GrammarBusy, GrammarChecker
from frontend.tenancy import FairShare, Requester
from tests.tiny_models import build_tokenizer

# Sixty strings of distinct maxLength (2.7 kB): tens of seconds to compile even on a tiny
# vocabulary, so it is still compiling when any deadline below passes.
SLOW = StructuredOutput("json_schema", json.dumps(
    {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 20 + 7 * i} for i in range(60)}}))
pytestmark = pytest.mark.asyncio(loop_scope="module")
A, B, C = (Requester(tenant="", client=address) for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"))


def regex(text: str) -> StructuredOutput:
    return StructuredOutput("regex", text)


def shares(total: int = 2, per_tenant: int = 2, per_client: int = 1) -> FairShare:
    return FairShare("grammar compiles", "--max-grammar-compiles", total, per_tenant, per_client)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared_checker():
    tokenizer = build_tokenizer()
    checker = GrammarChecker(tokenizer, len(tokenizer), deadline_s=0.5, shares=shares())
    await checker.check(regex("warm"), "guided_regex")  # the worker processes' cold start, once
    yield checker
    await checker.close()


@pytest_asyncio.fixture(loop_scope="module")
async def checker(shared_checker):
    """The shared checker with a 0.5 s deadline, two slots, one per client, nothing known."""
    checker = shared_checker
    checker.deadline_s, checker.shares = 0.5, shares()
    checker._known.clear()
    checker._slow_until.clear()
    yield checker
    # A compile the test left is cancelled, and a last small compile goes through the
    # server, so its replacements of killed workers are done before the next test looks.
    for compiling in list(checker._compiling.values()):
        compiling.task.cancel()
    await until(lambda: not checker._compiling)
    checker.shares = shares()
    await checker.check(regex(f"settled{time.monotonic()}"), "guided_regex")


def workers_of(checker) -> set[int]:
    return {child.pid for child in psutil.Process(checker.workers.server_pid).children()}


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


async def refused(checker, spec, requester, code: str) -> InvalidInput:
    with pytest.raises(InvalidInput) as refusal:
        await checker.check(spec, "guided_json", requester)
    assert refusal.value.code == code, refusal.value
    return refusal.value


async def test_a_compile_past_its_deadline_is_killed_and_frees_its_slot(checker):
    # Two clients' slow schemas fill both compile slots until their deadline, no longer:
    # after it a third client's small schema compiles at once, and the processes that ran
    # the slow compiles are gone (a thread could not be stopped and kept both slots).
    workers = workers_of(checker)
    started = time.monotonic()
    slow = [asyncio.create_task(refused(checker, StructuredOutput("json_schema", SLOW.spec.replace("p0", name)),
                                        requester, "grammar_too_complex"))
            for name, requester in (("x", A), ("y", C))]
    await asyncio.gather(*slow)
    assert time.monotonic() - started < 3.0
    assert "did not compile within 0.5 s" in str(slow[0].result())
    small = time.monotonic()
    await checker.check(regex("[a-z]{3}@example"), "guided_regex", B)
    assert time.monotonic() - small < 1.0
    assert checker.compiling == 0
    await until(lambda: not workers & workers_of(checker) and len(workers_of(checker)) == 2)
    assert not any(psutil.pid_exists(pid) for pid in workers)
    # Refused at once the second time: the outcome is remembered.
    again = time.monotonic()
    await refused(checker, StructuredOutput("json_schema", SLOW.spec.replace("p0", "x")), A, "grammar_too_complex")
    assert time.monotonic() - again < 0.1


async def test_a_client_past_its_share_is_refused_while_another_is_served(checker):
    slow = asyncio.create_task(checker.check(SLOW, "guided_json", A))
    await until(lambda: checker.compiling == 1)
    with pytest.raises(GrammarBusy, match="this client holds its share of 1 grammar compiles"):
        await checker.check(regex("[0-9]+"), "guided_regex", A)
    await checker.check(regex("[0-9]+"), "guided_regex", B)  # another client compiles meanwhile
    with pytest.raises(InvalidInput):
        await slow


async def test_a_tenant_past_its_share_is_refused_from_any_of_its_clients(checker):
    checker.shares = shares(total=4, per_tenant=1, per_client=2)
    slow = asyncio.create_task(checker.check(SLOW, "guided_json", Requester("tenant-1", "10.0.0.1")))
    await until(lambda: checker.compiling == 1)
    with pytest.raises(GrammarBusy, match="this API key holds its share of 1 grammar compiles"):
        await checker.check(regex("[0-9]+"), "guided_regex", Requester("tenant-1", "10.0.0.2"))
    await checker.check(regex("[0-9]+"), "guided_regex", Requester("tenant-2", "10.0.0.1"))
    with pytest.raises(InvalidInput):
        await slow


async def test_requests_for_the_same_spec_share_one_compile(checker):
    # Client B joins A's compile of the same spec: it takes no slot of its own (B can still
    # start a compile of another spec) and both get its outcome.
    first = asyncio.create_task(refused(checker, SLOW, A, "grammar_too_complex"))
    await until(lambda: checker.compiling == 1)
    second = asyncio.create_task(refused(checker, SLOW, B, "grammar_too_complex"))
    await asyncio.sleep(0.05)
    assert checker.compiling == 1
    await checker.check(regex("[a-z]+!"), "guided_regex", B)
    await asyncio.gather(first, second)


async def test_a_compile_nobody_waits_for_is_stopped_with_its_process(checker):
    checker.deadline_s = 60.0
    workers = workers_of(checker)
    waiters = [asyncio.create_task(checker.check(SLOW, "guided_json", requester)) for requester in (A, B)]
    await until(lambda: checker.compiling == 1)
    await asyncio.sleep(0.2)
    waiters[0].cancel()  # one client left: the other still waits, the compile goes on
    await asyncio.sleep(0.2)
    assert checker.compiling == 1 and workers_of(checker) == workers
    waiters[1].cancel()  # the last one left: the compile stops, its slot and process with it
    await asyncio.gather(*waiters, return_exceptions=True)
    assert checker.compiling == 0
    await until(lambda: len(workers & workers_of(checker)) == 1 and len(workers_of(checker)) == 2)
    (killed,) = workers - workers_of(checker)
    assert not psutil.pid_exists(killed)
    # Nothing was remembered: the spec compiles again when asked again.
    again = asyncio.create_task(checker.check(SLOW, "guided_json", A))
    await until(lambda: checker.compiling == 1)
    again.cancel()


async def test_a_bad_spec_is_a_400_naming_it(checker):
    with pytest.raises(InvalidInput) as refusal:
        await checker.check(regex("a(b"), "guided_regex")
    assert refusal.value.code == "invalid_grammar" and refusal.value.param == "guided_regex"
    assert "parenthesis" in str(refusal.value)
    assert checker.compiling == 0


@pytest.mark.parametrize("kind,spec", [
    ("grammar", "root ::= root"),
    ("grammar", 'root ::= "a" root'),
    ("json_schema", '{"$ref": "#"}'),
    ("json_schema", json.dumps({"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}})),
], ids=["self-rule", "endless-rule", "self-ref", "required-self-ref"])
async def test_a_grammar_that_matches_no_text_is_refused(checker, kind, spec):
    with pytest.raises(InvalidInput, match="can match no text") as refusal:
        await checker.check(StructuredOutput(kind, spec), "guided_grammar")
    assert refusal.value.code == "invalid_grammar"


async def test_a_worker_killed_mid_compile_fails_that_check_once_and_is_replaced(checker):
    checker.deadline_s = 60.0
    workers = workers_of(checker)
    slow = asyncio.create_task(checker.check(SLOW, "guided_json", A))
    # The busy worker is the one that has run for a while (the idle one has just been forked).
    cpu = lambda pid: psutil.Process(pid).cpu_times().user  # noqa: E731
    await until(lambda: any(cpu(pid) > 0.3 for pid in workers))
    busy = max(workers, key=cpu)
    psutil.Process(busy).kill()
    with pytest.raises(InvalidInput, match="the compile process ended .signal 9.") as refusal:
        await slow
    assert refusal.value.code == "grammar_too_complex"
    await until(lambda: busy not in workers_of(checker) and len(workers_of(checker)) == 2)
    assert workers_of(checker) & workers == workers - {busy}
    # Not held against the spec: asked again, it compiles again.
    again = asyncio.create_task(checker.check(SLOW, "guided_json", A))
    await until(lambda: checker.compiling == 1)
    again.cancel()


async def test_a_killed_compile_server_is_a_429_and_the_next_check_starts_a_new_one(checker):
    checker.deadline_s = 60.0
    server = psutil.Process(checker.workers.server_pid)
    workers = workers_of(checker)
    slow = asyncio.create_task(checker.check(SLOW, "guided_json", A))
    await until(lambda: checker.compiling == 1)
    server.kill()
    with pytest.raises(GrammarBusy, match="compile server exited"):
        await slow
    assert checker.compiling == 0
    # Its workers die with it rather than compile on as orphans.
    await until(lambda: not any(psutil.pid_exists(pid) for pid in workers))
    await checker.check(regex("[a-z]+ again"), "guided_regex", B)
    assert checker.workers.server_pid != server.pid and len(workers_of(checker)) == 2


async def test_with_tenants_apart_a_spec_one_tenant_compiled_is_compiled_anew_for_another(checker):
    # Known to tenant "a", a spec answers at once for "a" and is compiled again for "b": a
    # known spec answering in microseconds would tell "b" what "a" asks for.
    checker.per_tenant = True
    try:
        tenant_a, tenant_b = Requester("a", "10.0.0.1"), Requester("b", "10.0.0.2")
        spec = regex(f"tenant[0-9]+{time.monotonic()}")
        compiles = []
        original = checker.workers.compile

        async def counted(spec, deadline_s):
            compiles.append(spec)
            return await original(spec, deadline_s)

        checker.workers.compile = counted
        try:
            await checker.check(spec, "guided_regex", tenant_a)
            await checker.check(spec, "guided_regex", tenant_a)
            assert len(compiles) == 1
            await checker.check(spec, "guided_regex", tenant_b)
            assert len(compiles) == 2
        finally:
            checker.workers.compile = original
    finally:
        checker.per_tenant = False


async def test_a_client_whose_compile_ran_past_its_deadline_may_not_take_the_last_free_slot(checker):
    def slow(name: str) -> StructuredOutput:
        return StructuredOutput("json_schema", SLOW.spec.replace("p0", name))

    await refused(checker, slow("a1"), A, "grammar_too_complex")
    # C's compile holds one of the two slots: A's fresh slow schema may not take the last one,
    # so two clients cannot hold every slot between them with ever-new slow schemas.
    holding = asyncio.create_task(refused(checker, slow("c1"), C, "grammar_too_complex"))
    await until(lambda: checker.compiling == 1)
    with pytest.raises(GrammarBusy, match="last free"):
        await checker.check(slow("a2"), "guided_json", A)
    await checker.check(regex("[0-9]+honest"), "guided_regex", B)
    await holding
    # With both slots free A may compile again (it is not locked out, only kept off the last).
    await refused(checker, slow("a3"), A, "grammar_too_complex")
