"""What the OpenAI-compatible HTTP endpoints share: bounded bodies, error bodies, SSE
framing, usage, and watching for a client that leaves. The endpoints:
frontend/openai_chat.py, openai_completions.py (both run through request_lifecycle.py),
openai_audio.py.
"""

from __future__ import annotations

import asyncio
import json

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from frontend.admission import AdmissionRefused
from frontend.chat_audio import SpeechFailed
from frontend.edge_decoding import InvalidInput
from frontend.engine_errors import EngineUnavailable, VoiceBusy
from frontend.generation import TextChunk
from frontend.structured_output import GrammarBusy


class BodyTooLarge(Exception):
    pass


# What a handler may raise for a request the server refuses or cannot serve now.
REFUSALS = (InvalidInput, AdmissionRefused, GrammarBusy, SpeechFailed, EngineUnavailable)


def refusal(exc: Exception) -> Response:
    """The HTTP answer to one of REFUSALS."""
    forget_traceback(exc)
    if isinstance(exc, InvalidInput):
        return error_response(400, str(exc), exc.code, exc.param)
    if isinstance(exc, AdmissionRefused):
        return error_response(429, str(exc), exc.code, error_type="rate_limit_error",
                              headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, (GrammarBusy, VoiceBusy)):
        return error_response(429, str(exc), "grammar_busy" if isinstance(exc, GrammarBusy) else "voice_busy",
                              error_type="rate_limit_error", headers={"Retry-After": "1"})
    code = "voice_unavailable" if isinstance(exc, SpeechFailed) else "engine_unavailable"
    return error_response(503, str(exc), code, error_type="server_error")


def forget_traceback(exc: BaseException) -> None:
    """Drops the tracebacks of a refusal and of the exceptions it chains.

    A refusal is an answer, not a fault: nobody reads its traceback, and the traceback holds
    every frame it passed through (the request's body, its decoded messages, its rendered
    prompt). Those frames sit in reference cycles (a worker thread's future holds the
    exception that holds the future's frame), which only the collector's rare full pass
    frees: a flood of refused 1 MiB bodies kept ~60 MiB of dead requests alive and grew the
    front end by ~100 MiB (benchmarks/mixed_soak.py, the 1mib-body clients)."""
    seen = set()
    chained = [exc]
    while chained:
        exc = chained.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        exc.__traceback__ = None
        # `raise X from Y` sets both: the exception being handled stays in __context__.
        chained += (exc.__cause__, exc.__context__)


def error_response(status: int, message: str, code: str, param: str | None = None,
                   error_type: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                        status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it is known to be over `limit` bytes (before reading it all)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


async def body_or_error(request: Request, config, limit: int | None = None) -> bytes | Response:
    """The body within the size limit (default --max-message-bytes) and --body-timeout, or
    the error response to send instead."""
    limit = config.max_message_bytes if limit is None else limit
    try:
        async with asyncio.timeout(config.body_timeout_s):
            return await read_body(request, limit)
    except BodyTooLarge:
        return error_response(413, f"request body over {limit} bytes", "request_too_large")
    except TimeoutError:
        return error_response(408, f"the body did not arrive within {config.body_timeout_s:g} s", "request_timeout")
    except ClientDisconnect:
        return Response(status_code=400)


class ClientGone(Exception):
    """The client hung up before its answer was ready; the work it asked for is cancelled."""


async def unless_disconnected(gone: asyncio.Future, work):
    """`work`'s result (None included); ClientGone if the client went away first (the work is
    then cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    try:
        if task.cancelled() and gone.done():
            raise ClientGone()
        return task.result()  # a work that cancelled itself raises CancelledError here
    finally:
        # The task holds its exception, whose traceback holds this frame: without this the
        # request's frames would wait in that cycle for the collector's full pass.
        task = None


async def wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server gets is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage_of(last_chunks: list[TextChunk]) -> dict:
    """Usage of one prompt's choices (their last chunks): the prompt counted once."""
    first = last_chunks[0]
    details = {"cached_tokens": first.num_cached_tokens}
    if first.num_image_tokens:
        details["image_tokens"] = first.num_image_tokens
    if first.num_audio_tokens:
        # As OpenAI counts an audio input (its tokens as the model hears it).
        details["audio_tokens"] = first.num_audio_tokens
    completion = sum(chunk.num_output_tokens for chunk in last_chunks)
    return {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.num_prompt_tokens + completion, "prompt_tokens_details": details}


def sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
