"""OpenAI-compatible HTTP: /v1/chat/completions (plain and SSE), /v1/models.

Order of work for a request: read the body (size and time bounded), decode it into a
typed struct, admit it (a lease on a slot, or 429), and only then template and generate.
The lease is released however the request ends: normal end, error, a client that
disconnects mid-stream, or a client that disconnects while a plain answer is generated.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.admission import AdmissionRefused, RequestLease
from frontend.chat_request import ChatCompletionRequest
from frontend.edge_decoding import InvalidInput, decode_json
from frontend.chat_audio import SpeechFailed, SpokenAnswer, remember_transcript, transcribe_audio_parts
from frontend.engine_client import EngineUnavailable, VoiceBusy
from frontend.generation import TextChunk
from frontend.limits import bearer_token, cache_salt


class BodyTooLarge(Exception):
    pass


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


class LeasedStreamingResponse(StreamingResponse):
    """Releases the request's lease when the response ends, even if its body never started."""

    def __init__(self, lease: RequestLease, content, on_close=None, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.lease = lease
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.lease.release()
            if self.on_close is not None:
                self.on_close()  # e.g. a spoken answer's talker work, if the body never started


class ChatCompletions:
    def __init__(self, app_state) -> None:
        self.state = app_state

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.state.model_name, "object": "model", "created": self.state.started, "owned_by": "antiphon"}]})

    async def create(self, request: Request) -> Response:
        state, config = self.state, self.state.config
        body_bytes = await body_or_error(request, config)
        if isinstance(body_bytes, Response):
            return body_bytes
        try:
            body = decode_json(body_bytes, ChatCompletionRequest, "request body")
            params = body.sampling_params(config.default_max_tokens, config.max_stop_strings)
            messages = body.conversation()
            spoken_format = body.spoken_format()
            if spoken_format is not None and not state.engine_config.voice:
                raise InvalidInput("voice is off on this server (--no-voice)", "unsupported_modality", "modalities")
            if spoken_format == "wav" and body.stream:
                raise InvalidInput("streamed audio is pcm16: set audio.format to pcm16", "invalid_value",
                                   "audio.format")
            # Spoken parts become their transcripts (the encoder process hears them).
            await transcribe_audio_parts(state.client, messages, state.engine_config.voice,
                                         config.max_audio_buffer_seconds)
        except InvalidInput as exc:
            return error_response(400, str(exc), exc.code, exc.param)
        except VoiceBusy as exc:
            return error_response(429, str(exc), "voice_busy", error_type="rate_limit_error",
                                  headers={"Retry-After": "1"})
        except EngineUnavailable as exc:
            return error_response(503, str(exc), "engine_unavailable", error_type="server_error")
        try:
            lease = state.generation.admit(state.generation.new_request_id("chatcmpl"))
        except AdmissionRefused as exc:
            return error_response(429, str(exc), exc.code, error_type="rate_limit_error",
                                  headers={"Retry-After": str(exc.retry_after_s)})
        salt = cache_salt(config, bearer_token(request.headers.get("authorization")))
        # From here on a client that hangs up stops its request, before or after its first token.
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        handed_over = False
        spoken = None
        try:
            if spoken_format is not None:
                spoken = SpokenAnswer(state.client, lease.request_id, spoken_format)
            start = asyncio.ensure_future(self._first_chunk(lease, messages, params, salt))
            await asyncio.wait({start, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():
                start.cancel()
                await asyncio.gather(start, return_exceptions=True)
                return Response(status_code=499)  # nobody is listening any more
            stream, first = start.result()
            if body.stream:
                gone.cancel()  # the streaming response watches for the disconnect itself
                handed_over = True
                return LeasedStreamingResponse(
                    lease, self._sse(lease.request_id, first, stream, include_usage=(
                        body.stream_options.include_usage if body.stream_options else True),
                        return_token_ids=body.return_token_ids, spoken=spoken),
                    on_close=spoken.close if spoken is not None else None, media_type="text/event-stream")
            return await self._complete_unless_disconnected(gone, lease.request_id, first, stream, body, spoken)
        except InvalidInput as exc:
            return error_response(400, str(exc), exc.code, exc.param)
        except VoiceBusy as exc:
            return error_response(429, str(exc), "voice_busy", error_type="rate_limit_error",
                                  headers={"Retry-After": "1"})
        except EngineUnavailable as exc:
            return error_response(503, str(exc), "engine_unavailable", error_type="server_error")
        except SpeechFailed as exc:
            return error_response(503, str(exc), "voice_unavailable", error_type="server_error")
        finally:
            gone.cancel()
            if not handed_over:
                lease.release()
                if spoken is not None:
                    spoken.close()

    async def _first_chunk(self, lease: RequestLease, messages: list[dict], params, salt: str | None):
        generation = self.state.generation
        prompt = await generation.chat_prompt(messages)
        stream = generation.stream(lease, prompt, params, salt)
        return stream, await anext(stream)

    async def _complete_unless_disconnected(self, gone: asyncio.Future, request_id: str, first: TextChunk, stream,
                                            body: ChatCompletionRequest, spoken: SpokenAnswer | None) -> Response:
        """The whole answer; if the client goes away meanwhile, generation stops at once."""
        collect = asyncio.ensure_future(_collect(first, stream))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not collect.done():
                collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
            await stream.aclose()
        if collect.cancelled():
            return Response(status_code=499)  # nobody is listening any more
        chunks = collect.result()
        last = chunks[-1]
        if last.finish_reason == "error":
            return error_response(500, last.error or "generation failed", "engine_error", error_type="server_error")
        text = "".join(c.text for c in chunks)
        message = {"role": "assistant", "content": text}
        if spoken is not None:
            await spoken.say(text, final=True)
            pcm = await _unless_disconnected(gone, spoken.rest())
            if pcm is None:
                return Response(status_code=499)
            # As OpenAI's audio answers: the text is the audio's transcript.
            message = {"role": "assistant", "content": None, "audio": spoken.message_audio(b"".join(pcm), text)}
            remember_transcript(message["audio"]["id"], text)
        choice = {"index": 0, "message": message, "finish_reason": last.finish_reason, "logprobs": None}
        if body.return_token_ids:  # extension, as in vLLM
            choice["token_ids"] = [t for c in chunks for t in c.token_ids]
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.state.model_name, "choices": [choice], "usage": _usage(last),
        })

    async def _sse(self, request_id: str, first: TextChunk, stream, include_usage: bool, return_token_ids: bool,
                   spoken: SpokenAnswer | None = None):
        created = int(time.time())

        def event(delta: dict, finish_reason=None) -> str:
            return _sse_data({"id": request_id, "object": "chat.completion.chunk", "created": created,
                              "model": self.state.model_name,
                              "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

        try:
            # The role event goes out in the same write as the first token, not one write ahead.
            out = [event({"role": "assistant", "content": ""})]
            chunk = first
            while True:
                if chunk.finish_reason == "error":
                    out.append(_sse_data({"error": {"message": chunk.error, "type": "server_error",
                                                    "code": "engine_error"}}))
                    break
                if spoken is not None:
                    # A spoken answer: its text is the audio's transcript; audio follows as made.
                    try:
                        if chunk.text:
                            out.append(event({"audio": {"id": spoken.id, "transcript": chunk.text}}))
                            await spoken.say(chunk.text)
                        out += [event({"audio": {"id": spoken.id, "data": base64.b64encode(pcm).decode()}})
                                for pcm in spoken.ready()]
                        if chunk.finish_reason is not None:
                            await spoken.say("", final=True)
                            # The rest of the audio, each piece as soon as it is made.
                            while not spoken.ended:
                                yield "".join(out)
                                out = [event({"audio": {"id": spoken.id, "data": base64.b64encode(pcm).decode()}})
                                       for pcm in await spoken.next_pieces()]
                    except (SpeechFailed, EngineUnavailable) as exc:
                        out.append(_sse_data({"error": {"message": str(exc), "type": "server_error",
                                                        "code": "voice_unavailable"}}))
                        break
                elif chunk.text or (return_token_ids and chunk.token_ids):
                    delta = {"content": chunk.text}
                    if return_token_ids:
                        delta["token_ids"] = chunk.token_ids
                    out.append(event(delta))
                if chunk.finish_reason is not None:
                    out.append(event({}, chunk.finish_reason))
                    if include_usage:
                        out.append(_sse_data({"id": request_id, "object": "chat.completion.chunk", "created": created,
                                              "model": self.state.model_name, "choices": [], "usage": _usage(chunk)}))
                    break
                if out:
                    yield "".join(out)
                    out = []
                chunk = await anext(stream)
            out.append("data: [DONE]\n\n")
            yield "".join(out)
        finally:
            # Runs on normal end and when the client disconnects; the stream's own cleanup
            # releases the lease (the response releases it too, in case this never ran).
            if spoken is not None:
                spoken.close()
            await stream.aclose()


async def _unless_disconnected(gone: asyncio.Future, work):
    """`work`'s result, or None if the client went away first (the work is then cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _collect(first: TextChunk, stream) -> list[TextChunk]:
    return [first] + [chunk async for chunk in stream]


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server gets is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(chunk: TextChunk) -> dict:
    details = {"cached_tokens": chunk.num_cached_tokens}
    if chunk.num_image_tokens:
        details["image_tokens"] = chunk.num_image_tokens
    return {"prompt_tokens": chunk.num_prompt_tokens, "completion_tokens": chunk.num_output_tokens,
            "total_tokens": chunk.num_prompt_tokens + chunk.num_output_tokens, "prompt_tokens_details": details}


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
