"""OpenAI-compatible HTTP: /v1/chat/completions (plain and SSE), /v1/models."""

from __future__ import annotations

import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.sampling_params import SamplingParams
from frontend.engine_client import EngineUnavailable
from frontend.generation import RequestRejected, TextChunk
from frontend.limits import LimitExceeded


def error_response(status: int, message: str, code: str, param: str | None = None,
                   error_type: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                        status_code=status)


def sampling_from_openai(body: dict, default_max_tokens: int) -> SamplingParams:
    """OpenAI request fields -> SamplingParams; a bad value is a RequestRejected naming the field."""
    if body.get("n", 1) != 1:
        raise RequestRejected("only n=1 is supported", "unsupported_parameter", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop") or []
    fields = {
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "top_k": body.get("top_k", 0),
        "min_p": body.get("min_p", 0.0),
        "seed": body.get("seed"),
        "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "stop": [stop] if isinstance(stop, str) else stop,
        "presence_penalty": body.get("presence_penalty", 0.0),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
        "repetition_penalty": body.get("repetition_penalty", 1.0),
        "ignore_eos": body.get("ignore_eos", False),
        "logprobs": body.get("top_logprobs", 0) if body.get("logprobs") else None,
    }
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        param = next((name for name in fields if name in str(exc)), None)
        raise RequestRejected(str(exc), "invalid_value", param) from None


class ChatCompletions:
    def __init__(self, app_state) -> None:
        self.state = app_state

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.state.model_name, "object": "model", "created": self.state.started, "owned_by": "antiphon"}]})

    async def create(self, request: Request) -> Response:
        state = self.state
        body_bytes = await request.body()
        if len(body_bytes) > state.config.max_message_bytes:
            return error_response(413, f"request body over {state.config.max_message_bytes} bytes",
                                  "request_too_large")
        try:
            body = json.loads(body_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"malformed JSON: {exc}", "invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", "invalid_json")
        try:
            params = sampling_from_openai(body, state.config.default_max_tokens)
            prompt = await state.generation.chat_prompt(body.get("messages"))
            state.limiter.acquire()
        except RequestRejected as exc:
            return error_response(400, str(exc), exc.code, exc.param)
        except LimitExceeded as exc:
            return error_response(429, str(exc), exc.code, error_type="rate_limit_error")
        request_id = state.generation.new_request_id("chatcmpl")
        try:
            stream = state.generation.stream(prompt, params, request_id)
            first = await anext(stream)
        except EngineUnavailable as exc:
            state.limiter.release()
            return error_response(503, str(exc), "engine_unavailable", error_type="server_error")
        except BaseException:
            state.limiter.release()
            raise
        if body.get("stream"):
            include_usage = (body.get("stream_options") or {}).get("include_usage", True)
            return StreamingResponse(self._sse(request_id, first, stream, include_usage,
                                               bool(body.get("return_token_ids"))),
                                     media_type="text/event-stream")
        try:
            chunks = [first] + [chunk async for chunk in stream]
        finally:
            state.limiter.release()
        last = chunks[-1]
        if last.finish_reason == "error":
            return error_response(500, last.error or "generation failed", "engine_error", error_type="server_error")
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(c.text for c in chunks)},
                  "finish_reason": last.finish_reason, "logprobs": None}
        if body.get("return_token_ids"):  # extension, as in vLLM
            choice["token_ids"] = [t for c in chunks for t in c.token_ids]
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name, "choices": [choice], "usage": _usage(last),
        })

    async def _sse(self, request_id: str, first: TextChunk, stream, include_usage: bool, return_token_ids: bool):
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
                if chunk.text or (return_token_ids and chunk.token_ids):
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
            # Runs on normal end and when the client disconnects: the stream's own cleanup
            # aborts the engine request and frees its blocks.
            await stream.aclose()
            self.state.limiter.release()


def _usage(chunk: TextChunk) -> dict:
    return {"prompt_tokens": chunk.num_prompt_tokens, "completion_tokens": chunk.num_output_tokens,
            "total_tokens": chunk.num_prompt_tokens + chunk.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": chunk.num_cached_tokens}}


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
