"""The one lifecycle chat completions and completions share: what a request holds is released
however it ends (a refusal, a client gone, a failed generation, a stream that runs out), and
each ending gets its own status. Run here on a hand-built request, with no engine."""

import asyncio
import json

from starlette.requests import Request

from frontend.admission import Admission
from frontend.choices import Choice
from frontend.edge_decoding import InvalidInput
from frontend.generation import TextChunk
from frontend.request_lifecycle import answer_request
from frontend.server_config import ServerConfig


class FakeGeneration:
    """Admission as GenerationService does it; it stands for the engine too, and records the
    requests released there."""

    def __init__(self, capacity: int = 4) -> None:
        self.admission = Admission(capacity)
        self.released: list[str] = []

    def admit(self, request_id: str):
        return self.admission.admit(self, request_id)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-1"

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def http_request(body: bytes, leaves: bool = False) -> Request:
    """A request whose body arrives whole; then its client either stays or hangs up."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if leaves:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # stays connected

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "client": ("10.0.0.1", 1234),
             "asgi": {"version": "3.0", "spec_version": "2.4"}}
    return Request(scope, receive)


async def test_a_refusal_after_admission_releases_every_lease_and_what_the_handler_added():
    generation, closed = FakeGeneration(), []

    async def handle(lifecycle, body: bytes):
        assert lifecycle.admit("cmpl", 2) == "cmpl-1"
        lifecycle.on_release(lambda: closed.append(generation.admission.held))
        raise InvalidInput("no such thing", "invalid_value", "prompt")

    response = await answer_request(http_request(b"{}"), ServerConfig(), generation, handle)

    assert response.status_code == 400 and json.loads(response.body)["error"]["param"] == "prompt"
    assert generation.admission.held == 0 and generation.released == ["cmpl-1", "cmpl-1-1"]
    assert closed == [0]  # after the leases


async def test_a_client_that_leaves_while_its_request_is_checked_gets_499_and_the_check_stops():
    generation, cancelled = FakeGeneration(), []

    async def checking_forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def handle(lifecycle, body: bytes):
        await lifecycle.while_connected(checking_forever())
        raise AssertionError("unreachable: the client is gone")

    response = await answer_request(http_request(b"{}", leaves=True), ServerConfig(), generation, handle)

    assert response.status_code == 499 and cancelled == [True] and generation.admission.held == 0


async def test_work_that_answers_none_is_an_answer_not_a_client_gone():
    generation = FakeGeneration()

    async def nothing():
        return None

    async def handle(lifecycle, body: bytes):
        assert await lifecycle.while_connected(nothing()) is None
        raise InvalidInput("refused after the check", "invalid_value", "prompt")

    response = await answer_request(http_request(b"{}"), ServerConfig(), generation, handle)

    assert response.status_code == 400


async def test_a_whole_answer_with_a_failed_choice_is_a_500_engine_error():
    generation = FakeGeneration()

    async def no_more():
        return
        yield

    async def handle(lifecycle, body: bytes):
        lifecycle.admit("chatcmpl", 1)
        failed = TextChunk("", [], finish_reason="error", error="the decoder died")
        await lifecycle.all_chunks([Choice(0, no_more(), failed)])
        raise AssertionError("unreachable: the choice failed")

    response = await answer_request(http_request(b"{}"), ServerConfig(), generation, handle)

    assert response.status_code == 500
    assert json.loads(response.body)["error"] == {"message": "the decoder died", "type": "server_error",
                                                  "param": None, "code": "engine_error"}
    assert generation.admission.held == 0


async def test_a_streamed_answer_holds_its_leases_until_its_body_has_been_sent():
    generation, closed = FakeGeneration(), []

    async def events():
        yield "data: one\n\n"
        yield "data: [DONE]\n\n"

    async def handle(lifecycle, body: bytes):
        lifecycle.admit("chatcmpl", 1)
        lifecycle.on_release(lambda: closed.append(True))
        return lifecycle.stream(events())

    request = http_request(b"{}")
    response = await answer_request(request, ServerConfig(), generation, handle)
    assert generation.admission.held == 1 and closed == []  # handed over, not released

    sent = []

    async def send(message: dict) -> None:
        sent.append(message)

    await response(request.scope, request.receive, send)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert b"".join(m.get("body", b"") for m in sent) == b"data: one\n\ndata: [DONE]\n\n"
    assert generation.admission.held == 0 and closed == [True]


async def test_a_closer_that_raises_does_not_keep_the_others_from_running_and_release_runs_once():
    """Every lease and every closer runs whatever one of them raises (the error comes after), a
    second release does nothing, and choices are admitted once."""
    generation, closed = FakeGeneration(), []
    lifecycle = None

    async def handle(current, body: bytes):
        nonlocal lifecycle
        lifecycle = current
        current.admit("cmpl", 2)
        try:
            current.admit("cmpl", 1)
        except RuntimeError:
            closed.append("admitted once")

        def broken() -> None:
            raise OSError("a closer that fails")
        current.on_release(broken)
        current.on_release(lambda: closed.append("after the broken one"))
        try:
            current.release()
        except OSError:
            closed.append("raised after the others")
        current.release()
        return json.dumps({}).encode()

    await answer_request(http_request(b"{}"), ServerConfig(), generation, handle)
    assert closed == ["admitted once", "after the broken one", "raised after the others"]
    assert generation.released == ["cmpl-1", "cmpl-1-1"] and generation.admission.held == 0
