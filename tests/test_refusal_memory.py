"""A refused request's memory is freed when it is answered, not at the collector's full pass.

A refusal's traceback holds every frame it passed through (the body, the decoded messages,
the rendered prompt), and asyncio's and anyio's futures put those frames in reference cycles:
a flood of refused 1 MiB bodies kept them alive by the dozen and grew the front end (the
mixed soak's 1mib-body clients). And the front end's heap hands back what it keeps free."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import anyio
import pytest

from frontend import heap_trimmer
from frontend.edge_decoding import InvalidInput
from frontend.openai_http import forget_traceback, refusal, unless_disconnected
from workers import heap


class Body:
    """Stands for a request's body: weak-referenceable, so the test sees when it dies."""


def test_a_refused_request_holds_nothing_once_answered():
    alive = []

    def render(body: Body) -> None:  # in a worker thread, as the chat template is
        raise InvalidInput("the prompt is too long", "prompt_too_long", "messages")

    async def plan(body: Body) -> None:
        await anyio.to_thread.run_sync(render, body)

    async def handler() -> int:
        body = Body()
        alive.append(weakref.ref(body))
        gone = asyncio.get_running_loop().create_future()
        try:
            await unless_disconnected(gone, plan(body))
        except InvalidInput as exc:
            return refusal(exc).status_code
        finally:
            del body

    gc.disable()  # what only the collector would free counts as held
    try:
        assert asyncio.run(handler()) == 400
        # anyio's worker thread reports the result before it drops its own reference to the
        # call's arguments: give it a moment. A cycle would hold the body for good, since the
        # collector is off.
        deadline = time.monotonic() + 5.0
        while alive[0]() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alive[0]() is None
    finally:
        gc.enable()


def test_the_task_of_a_refused_request_holds_nothing_even_with_its_traceback(monkeypatch):
    """unless_disconnected lets go of its task: the traceback (kept, here) does not keep the
    request's frames in a cycle through the task."""
    alive = []

    async def plan(body: Body) -> None:
        raise InvalidInput("the prompt is too long", "prompt_too_long", "messages")

    async def handler() -> bool:
        body = Body()
        alive.append(weakref.ref(body))
        gone = asyncio.get_running_loop().create_future()
        try:
            await unless_disconnected(gone, plan(body))
        except InvalidInput as exc:
            return exc.__traceback__ is not None
        finally:
            del body

    gc.disable()
    try:
        assert asyncio.run(handler())
        assert alive[0]() is None
    finally:
        gc.enable()


def test_a_refusal_forgets_the_tracebacks_of_every_exception_it_chains():
    def failing():
        try:
            try:
                raise KeyError("being handled")
            except KeyError:
                # `from` names another exception: the one being handled stays only in
                # __context__, and a walk of __cause__ alone would keep its frames alive.
                raise ValueError("cause") from OSError("named cause")
        except ValueError as cause:
            raise InvalidInput("refused", "invalid_request") from cause

    try:
        failing()
    except InvalidInput as exc:
        refused = exc
    handled = refused.__cause__.__context__
    assert isinstance(handled, KeyError) and handled is not refused.__cause__.__cause__
    chain = [refused, refused.__cause__, handled]
    assert all(exc.__traceback__ is not None for exc in chain)
    forget_traceback(refused)
    assert [exc.__traceback__ for exc in chain] == [None, None, None]


def test_the_heap_is_trimmed_only_when_its_free_memory_grows_much(monkeypatch):
    trims = []
    free = {"bytes": 8 << 20}
    monkeypatch.setattr(heap, "free_bytes", lambda: free["bytes"])

    def trim():
        trims.append(free["bytes"])
        free["bytes"] = 30 << 20  # glibc still counts the pages it handed back as free
        return True

    monkeypatch.setattr(heap, "trim", trim)
    state = heap_trimmer.TrimState(last_trim=time.monotonic())
    assert not heap_trimmer.trim_if_grown(state, 32 << 20) and trims == []
    free["bytes"] = 64 << 20
    assert heap_trimmer.trim_if_grown(state, 32 << 20)
    assert trims == [64 << 20] and state.baseline == 30 << 20
    # What a trim left is the mark: no trim again until the free memory grows by the threshold.
    assert not heap_trimmer.trim_if_grown(state, 32 << 20) and len(trims) == 1
    free["bytes"] = 20 << 20  # the heap reused some: the mark follows it down
    assert not heap_trimmer.trim_if_grown(state, 32 << 20) and state.baseline == 20 << 20
    free["bytes"] = 60 << 20
    assert heap_trimmer.trim_if_grown(state, 32 << 20) and state.baseline == 30 << 20 and len(trims) == 2


def test_a_heap_that_holds_much_free_is_trimmed_now_and_then_even_without_growth(monkeypatch):
    """Pages a trim released, used again by a burst and freed, are resident though the free
    count is back where the last trim left it: a periodic trim hands them back."""
    trims = []
    monkeypatch.setattr(heap, "free_bytes", lambda: 40 << 20)
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1) or True)
    state = heap_trimmer.TrimState(baseline=40 << 20, last_trim=time.monotonic())
    assert not heap_trimmer.trim_if_grown(state, 32 << 20, at_least_every_s=60.0) and trims == []
    state.last_trim -= 61.0
    assert heap_trimmer.trim_if_grown(state, 32 << 20, at_least_every_s=60.0) and trims == [1]
    # A heap with little free is left alone however long ago the last trim was.
    monkeypatch.setattr(heap, "free_bytes", lambda: 4 << 20)
    state.last_trim -= 1000.0
    assert not heap_trimmer.trim_if_grown(state, 32 << 20, at_least_every_s=60.0) and trims == [1]


def test_an_operators_malloc_arena_max_wins(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "limit_arenas", lambda count: calls.append(count) or True)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    assert not heap.limit_arenas_unless_set(2) and calls == []
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=4")
    assert not heap.limit_arenas_unless_set(2) and calls == []
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    assert heap.limit_arenas_unless_set(2) and calls == [2]
    assert 2 <= heap.arenas_for_a_front_end() <= 8


def test_glibc_says_what_its_heap_holds_free():
    if heap.free_bytes() is None:
        pytest.skip("this C library has no mallinfo2 (glibc 2.33+)")
    blocks = [bytearray(100_000) for _ in range(400)]  # under the mmap threshold: from the heap
    before = heap.free_bytes()
    del blocks[::2]  # every other one: free, and not at the heap's top
    assert heap.free_bytes() >= before + 150 * 100_000
