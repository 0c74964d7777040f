"""One Realtime API WebSocket connection: OpenAI Realtime events over a kept conversation.

Client events: session.update, conversation.item.create, response.create, response.cancel
(GA names; beta field names such as max_response_output_tokens and "text" content parts are
accepted too). Server events: session.created/updated, conversation.item.added,
response.created, response.output_item.added, response.content_part.added,
response.output_text.delta/done, response.content_part.done, response.output_item.done,
response.done (with usage and cached-token counts) and error.

A response bound to the conversation (the default) appends its answer to the history; only
one runs at a time. Responses with "conversation": "none" run beside it on their own input.
Any bad event gets an `error` event with a code and the connection carries on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from engine.sampling_params import SamplingParams
from frontend.engine_client import EngineUnavailable
from frontend.generation import RequestRejected
from frontend.limits import LimitExceeded

logger = logging.getLogger("antiphon.realtime")

TEXT_PART_TYPES = {"input_text", "text", "output_text"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class ClientError(Exception):
    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class RealtimeSession:
    def __init__(self, websocket: WebSocket, state) -> None:
        self.ws = websocket
        self.state = state
        self.config = state.config
        self.session = {
            "id": new_id("sess"), "object": "realtime.session", "type": "realtime", "model": state.model_name,
            "output_modalities": ["text"], "instructions": "", "max_output_tokens": "inf",
            "temperature": 0.8, "top_p": 1.0, "seed": None,
        }
        self.items: list[dict] = []
        self.responses: dict[str, asyncio.Task] = {}
        self.conversation_response: str | None = None
        self.last_activity = time.monotonic()
        self.send_lock = asyncio.Lock()
        # Event ids go out with every token: the session's random id plus a counter is as
        # unique as a fresh uuid4 per event, without a urandom call on the hot path.
        self._event_ids = (f"event_{self.session['id'][5:]}_{n}" for n in itertools.count())

    # ---- connection ---------------------------------------------------------------------

    async def run(self) -> None:
        watchdog = asyncio.create_task(self._close_when_idle())
        try:
            await self.send({"type": "session.created", "session": self.session})
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self.last_activity = time.monotonic()
                data = message.get("text")
                if data is None:
                    data = (message.get("bytes") or b"").decode("utf-8", errors="replace")
                await self._handle_raw(data)
        except WebSocketDisconnect:
            pass
        finally:
            watchdog.cancel()
            # A client that goes away mid-stream frees its requests and KV blocks at once.
            for task in list(self.responses.values()):
                task.cancel()
            if self.responses:
                await asyncio.gather(*self.responses.values(), return_exceptions=True)

    async def _close_when_idle(self) -> None:
        timeout = self.config.idle_timeout_s
        while True:
            await asyncio.sleep(min(timeout, 1.0))
            if not self.responses and time.monotonic() - self.last_activity > timeout:
                await self.send_error(f"closed after {timeout:g} s without activity", "idle_timeout")
                await self.ws.close(code=1000, reason="idle timeout")
                return

    async def _handle_raw(self, data: str) -> None:
        if len(data.encode("utf-8")) > self.config.max_message_bytes:
            await self.send_error(f"message over {self.config.max_message_bytes} bytes", "message_too_large")
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError as exc:
            await self.send_error(f"malformed JSON: {exc}", "invalid_json")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            await self.send_error("an event is a JSON object with a string 'type'", "invalid_event", "type")
            return
        handler = self.handlers.get(event["type"])
        try:
            if handler is None:
                raise ClientError(f"unknown event type {event['type']!r}", "unknown_event_type", "type")
            await handler(self, event)
        except ClientError as exc:
            await self.send_error(str(exc), exc.code, exc.param, event.get("event_id"))

    # ---- client events ----------------------------------------------------------------------

    async def on_session_update(self, event: dict) -> None:
        update = _object(event, "session")
        if "max_response_output_tokens" in update:  # beta name
            update["max_output_tokens"] = update.pop("max_response_output_tokens")
        if "modalities" in update:  # beta name
            update["output_modalities"] = update.pop("modalities")
        modalities = update.get("output_modalities", ["text"])
        if not isinstance(modalities, list) or any(m not in ("text", "audio") for m in modalities):
            raise ClientError("output_modalities must be a list of 'text' or 'audio'", "invalid_value",
                              "session.output_modalities")
        if "audio" in modalities:
            raise ClientError("audio output is not available on this server yet", "unsupported_modality",
                              "session.output_modalities")
        candidate = {**self.session, **{k: v for k, v in update.items() if k in self.session and k != "id"}}
        _sampling(candidate, {}, self.config.default_max_tokens)  # validates before anything changes
        self.session = candidate
        await self.send({"type": "session.updated", "session": self.session})

    async def on_item_create(self, event: dict) -> None:
        item = _message_item(_object(event, "item"))
        self.items.append(item)
        await self.send({"type": "conversation.item.added", "previous_item_id": None, "item": item})

    async def on_response_create(self, event: dict) -> None:
        options = event.get("response") or {}
        if not isinstance(options, dict):
            raise ClientError("response must be an object", "invalid_value", "response")
        out_of_band = options.get("conversation") == "none"
        if not out_of_band and self.conversation_response is not None:
            raise ClientError("the conversation already has an active response; cancel it or wait",
                              "conversation_already_has_active_response")
        if len(self.responses) >= self.config.max_concurrent_per_connection:
            raise ClientError(f"at most {self.config.max_concurrent_per_connection} responses at once "
                              "on one connection", "too_many_responses")
        if out_of_band and "input" in options:
            items = [_message_item(i) for i in options["input"]]
        else:
            items = list(self.items)
        params = _sampling(self.session, options, self.config.default_max_tokens)
        instructions = options.get("instructions", self.session["instructions"])
        messages = ([{"role": "system", "content": instructions}] if instructions else [])
        messages += [{"role": i["role"], "content": _item_text(i)} for i in items]
        try:
            prompt = await self.state.generation.chat_prompt(messages)
            self.state.limiter.acquire()
        except RequestRejected as exc:
            raise ClientError(str(exc), exc.code, exc.param) from None
        except LimitExceeded as exc:
            raise ClientError(str(exc), exc.code) from None
        response_id = new_id("resp")
        if not out_of_band:
            self.conversation_response = response_id
        self.responses[response_id] = asyncio.create_task(
            self._respond(response_id, prompt, params, not out_of_band, event.get("event_id")))

    async def on_response_cancel(self, event: dict) -> None:
        response_id = event.get("response_id") or self.conversation_response
        task = self.responses.get(response_id) if response_id else None
        if task is None:
            raise ClientError("there is no active response to cancel", "response_cancel_not_active",
                              "response_id")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    handlers = {
        "session.update": on_session_update,
        "conversation.item.create": on_item_create,
        "response.create": on_response_create,
        "response.cancel": on_response_cancel,
    }

    # ---- one response ---------------------------------------------------------------------

    async def _respond(self, response_id: str, prompt: list[int], params: SamplingParams,
                       in_conversation: bool, client_event_id: str | None) -> None:
        item = {"id": new_id("item"), "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        response = {"id": response_id, "object": "realtime.response", "status": "in_progress",
                    "status_details": None, "output": [], "output_modalities": ["text"], "usage": None,
                    "conversation_id": self.session["id"] if in_conversation else None}
        where = {"response_id": response_id, "item_id": item["id"], "output_index": 0, "content_index": 0}
        text, last = "", None
        stream = self.state.generation.stream(prompt, params, response_id)
        # Submit the engine request first and announce the response while the prefill runs:
        # the three events below are not on the way to the first token. Sending them does not
        # yield to the loop, so without this sleep(0) the task would submit only after all
        # three (measured: 0.5 ms of TTFT).
        first = asyncio.create_task(anext(stream, None))
        try:
            await asyncio.sleep(0)
            await self.send({"type": "response.created", "response": response})
            await self.send({"type": "response.output_item.added", "response_id": response_id, "output_index": 0,
                             "item": item})
            await self.send({"type": "response.content_part.added", **where,
                             "part": {"type": "output_text", "text": ""}})
            chunk = await first
            while chunk is not None:
                last = chunk
                if chunk.text:
                    text += chunk.text
                    await self.send({"type": "response.output_text.delta", **where, "delta": chunk.text})
                chunk = await anext(stream, None)
            response["status"] = {"stop": "completed", "length": "incomplete"}.get(last.finish_reason, "failed")
            if last.finish_reason == "length":
                response["status_details"] = {"type": "incomplete", "reason": "max_output_tokens"}
            elif response["status"] == "failed":
                response["status_details"] = {"type": "failed", "error": {"type": "server_error",
                                                                           "code": "engine_error",
                                                                           "message": last.error}}
                await self.send_error(last.error or "generation failed", "engine_error", None, client_event_id)
        except EngineUnavailable as exc:
            response["status"] = "failed"
            response["status_details"] = {"type": "failed", "error": {"type": "server_error",
                                                                       "code": "engine_unavailable",
                                                                       "message": str(exc)}}
            await self.send_error(str(exc), "engine_unavailable", None, client_event_id)
        except asyncio.CancelledError:
            response["status"] = "cancelled"
            response["status_details"] = {"type": "cancelled", "reason": "client_cancelled"}
        finally:
            # Cancelled before the first chunk: stop the pending step, whose cleanup aborts the
            # engine request; then close the stream (a no-op if it already ended).
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await stream.aclose()
            self.state.limiter.release()
            self.responses.pop(response_id, None)
            if self.conversation_response == response_id:
                self.conversation_response = None
            item["status"] = "completed" if response["status"] == "completed" else "incomplete"
            item["content"] = [{"type": "output_text", "text": text}]
            if in_conversation and text:
                self.items.append(item)
            response["output"] = [item]
            if last is not None:
                response["usage"] = {
                    "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
                    "input_tokens": last.num_prompt_tokens, "output_tokens": last.num_output_tokens,
                    "input_token_details": {"cached_tokens": last.num_cached_tokens,
                                            "text_tokens": last.num_prompt_tokens, "audio_tokens": 0},
                    "output_token_details": {"text_tokens": last.num_output_tokens, "audio_tokens": 0},
                }
            await self.send({"type": "response.output_text.done", **where, "text": text})
            await self.send({"type": "response.content_part.done", **where,
                             "part": {"type": "output_text", "text": text}})
            await self.send({"type": "response.output_item.done", "response_id": response_id, "output_index": 0,
                             "item": item})
            await self.send({"type": "response.done", "response": response})

    # ---- sending ------------------------------------------------------------------------

    async def send(self, event: dict) -> None:
        event = {"event_id": next(self._event_ids), **event}
        async with self.send_lock:
            if self.ws.application_state != WebSocketState.CONNECTED:
                return
            try:
                await self.ws.send_text(json.dumps(event))
            except (WebSocketDisconnect, RuntimeError):
                pass  # the client is gone; the receive loop sees the disconnect

    async def send_error(self, message: str, code: str, param: str | None = None,
                         client_event_id: str | None = None) -> None:
        await self.send({"type": "error", "error": {
            "type": "invalid_request_error" if code not in ("engine_error", "engine_unavailable") else "server_error",
            "code": code, "message": message, "param": param, "event_id": client_event_id}})


def _object(event: dict, key: str) -> dict:
    value = event.get(key)
    if not isinstance(value, dict):
        raise ClientError(f"'{key}' must be an object", "invalid_value", key)
    return dict(value)


def _message_item(item) -> dict:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise ClientError("only message items are supported", "unsupported_item_type", "item.type")
    role = item.get("role")
    if role not in ("user", "system", "assistant"):
        raise ClientError("item.role must be user, system or assistant", "invalid_value", "item.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise ClientError("item.content must be a non-empty list of content parts", "invalid_value",
                          "item.content")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ClientError(f"content part type {kind!r} is not supported yet; send text",
                              "unsupported_content_type", "item.content")
        if not isinstance(part.get("text"), str):
            raise ClientError("a text content part needs a string 'text'", "invalid_value", "item.content")
        parts.append({"type": part["type"], "text": part["text"]})
    return {"id": item.get("id") or new_id("item"), "object": "realtime.item", "type": "message",
            "role": role, "status": "completed", "content": parts}


def _item_text(item: dict) -> str:
    return "".join(part["text"] for part in item["content"])


def _sampling(session: dict, overrides: dict, default_max_tokens: int) -> SamplingParams:
    settings = {**session, **{k: v for k, v in overrides.items() if k in session}}
    if "max_response_output_tokens" in overrides:
        settings["max_output_tokens"] = overrides["max_response_output_tokens"]
    max_tokens = settings["max_output_tokens"]
    try:
        return SamplingParams(temperature=settings["temperature"], top_p=settings["top_p"], seed=settings["seed"],
                              max_tokens=default_max_tokens if max_tokens == "inf" else max_tokens)
    except ValueError as exc:
        field = next((f for f in ("temperature", "top_p", "seed", "max_tokens") if f in str(exc)), None)
        param = "max_output_tokens" if field == "max_tokens" else field
        raise ClientError(str(exc), "invalid_value", f"session.{param}" if param else None) from None
