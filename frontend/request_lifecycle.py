"""One generation request over HTTP, from its body to its answer: what chat completions and
completions do alike, so that each handler keeps only its own request, prompt and chunks.

The order is the same for both: the body is read (size and time bounded); the requester and
the cache salt come from its API key; from then on a client that hangs up stops the request
(its checks, its grammar compile, its templating, its generation before or after its first
token), answered 499; its choices are admitted (a lease each, all or a 429) before any
prompt work; then the answer is either collected whole, or handed to a streaming response
that takes over the release. What the request holds (its leases, and anything the handler
adds, such as a spoken answer's talker work) is released however it ends: an answer, a
refusal, an error, a client that leaves, or a stream that never started.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from frontend.admission import RequestLease
from frontend.choices import Choice, admit_choices, collect_all, start_choices
from frontend.generation import GenerationService, TextChunk
from frontend.limits import bearer_token, cache_salt, requester_of
from frontend.openai_http import (REFUSALS, ClientGone, body_or_error, error_response, refusal,
                                  unless_disconnected, wait_for_disconnect)


class GenerationFailed(Exception):
    """A choice of a whole (not streamed) answer ended in an engine error."""


class LeasedStreamingResponse(StreamingResponse):
    """A streamed answer that releases what its request holds when it ends, even if its body
    never started (a client gone before the first byte)."""

    def __init__(self, release: Callable[[], None], content, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


class RequestLifecycle:
    """What one request holds between its body and its answer, and the steps that use it."""

    def __init__(self, request: Request, config, generation: GenerationService) -> None:
        presented = bearer_token(request.headers.get("authorization"))
        self.requester = requester_of(config, presented, request.scope)
        self.cache_salt = cache_salt(config, presented)
        self.generation = generation
        self.leases: list[RequestLease] = []
        self._on_release: list[Callable[[], None]] = []
        self._handed_over = False
        self._released = False
        self._gone = asyncio.ensure_future(wait_for_disconnect(request))

    async def while_connected(self, work: Awaitable):
        """`work`'s result; ClientGone if the client leaves first (the work is then cancelled)."""
        return await unless_disconnected(self._gone, work)

    def admit(self, id_prefix: str, count: int) -> str:
        """Admits `count` choices, all or none (AdmissionRefused); the response's id."""
        if self.leases:
            raise RuntimeError("a request's choices are admitted once")
        self.leases = admit_choices(self.generation, self.generation.new_request_id(id_prefix), count)
        return self.leases[0].request_id

    def on_release(self, close: Callable[[], None]) -> None:
        """`close` runs when the leases are released, after them."""
        self._on_release.append(close)

    async def start(self, prompts: list, params: list, speech=None) -> list[Choice]:
        """Every admitted choice started, each with its first chunk, under this key's cache salt
        (`speech`: see start_choices)."""
        return await self.while_connected(start_choices(self.generation, self.leases, prompts, params,
                                                        self.cache_salt, speech=speech))

    async def all_chunks(self, choices: list[Choice]) -> list[list[TextChunk]]:
        """Every choice's chunks, for an answer sent whole; GenerationFailed if one ended in error."""
        all_chunks = await self.while_connected(collect_all(choices))
        for chunks in all_chunks:
            if chunks[-1].finish_reason == "error":
                raise GenerationFailed(chunks[-1].error or "generation failed")
        return all_chunks

    def stream(self, events: AsyncIterator[str]) -> Response:
        """The SSE response, which from now on owns the release and watches for the disconnect."""
        self._gone.cancel()
        self._handed_over = True
        return LeasedStreamingResponse(self.release, events, media_type="text/event-stream")

    def release(self) -> None:
        """Every lease, then every closer, each whatever the others raise; once."""
        if self._released:
            return
        self._released = True
        errors = []
        for release in [lease.release for lease in self.leases] + self._on_release:
            try:
                release()
            except Exception as exc:  # noqa: BLE001 - the others must still run; raised after them
                errors.append(exc)
        if errors:
            raise errors[0]

    def end(self) -> None:
        self._gone.cancel()
        if not self._handed_over:
            self.release()


async def answer_request(request: Request, config, generation: GenerationService,
                         handle: Callable[[RequestLifecycle, bytes], Awaitable[Response]]) -> Response:
    """`handle`'s answer to the request's body, run through one lifecycle: the body's own
    errors (413, 408), 499 for a client gone, 500 for a failed generation, a refusal's
    status (400, 429, 503), and the release once the answer is made."""
    body = await body_or_error(request, config)
    if isinstance(body, Response):
        return body
    lifecycle = RequestLifecycle(request, config, generation)
    try:
        return await handle(lifecycle, body)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening any more
    except GenerationFailed as exc:
        return error_response(500, str(exc), "engine_error", error_type="server_error")
    except REFUSALS as exc:
        return refusal(exc)
    finally:
        lifecycle.end()
