"""A refused request's memory is freed when it is answered, not at the collector's full pass.

A refusal's traceback holds every frame it passed through (the body, the decoded messages,
the rendered prompt), and asyncio's and anyio's futures put those frames in reference cycles:
a flood of refused 1 MiB bodies kept them alive by the dozen and grew the front end (the
mixed soak's 1mib-body clients). And the front end's heap hands back what it keeps free."""

from __future__ import annotations

import asyncio
import gc
import weakref

import anyio
import pytest

from frontend import heap_trimmer
from frontend.edge_decoding import InvalidInput
from frontend.openai_http import refusal, unless_disconnected
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
        assert alive[0]() is None
    finally:
        gc.enable()


def test_the_heap_is_trimmed_only_when_it_holds_much_free_memory(monkeypatch):
    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1) or True)
    monkeypatch.setattr(heap, "free_bytes", lambda: 8 << 20)
    assert not heap_trimmer.trim_if_mostly_free(32 << 20) and trims == []
    monkeypatch.setattr(heap, "free_bytes", lambda: 64 << 20)
    assert heap_trimmer.trim_if_mostly_free(32 << 20) and trims == [1]


def test_glibc_says_what_its_heap_holds_free():
    if heap.free_bytes() is None:
        pytest.skip("this C library has no mallinfo2 (glibc 2.33+)")
    blocks = [bytearray(100_000) for _ in range(400)]  # under the mmap threshold: from the heap
    before = heap.free_bytes()
    del blocks[::2]  # every other one: free, and not at the heap's top
    assert heap.free_bytes() >= before + 150 * 100_000
