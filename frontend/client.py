"""A Python async client for Antiphon's Realtime WebSocket (standard library + websockets).

    async with RealtimeClient("ws://127.0.0.1:8000/v1/realtime") as client:
        await client.update_session(temperature=0, max_output_tokens=64)
        response = await client.create_response([{"role": "user", "content": "Hello!"}])
        async for text in response:
            print(text, end="", flush=True)
        print(response.status, response.usage)

Messages sent to `create_response` join the connection's conversation, so a second call
continues it. `response.cancel()` stops a response early. A message's content is a string or
a list of parts: text, and images as `image_part(path or bytes)` (sent inline as data URLs):

    await client.create_response([{"role": "user", "content": [image_part("cat.jpg"), "What is this?"]}])

Voice (24 kHz 16-bit mono PCM both ways): send audio with `append_audio` (server VAD finds
the turns and starts the answers: `await client.next_response()`), or `commit_audio()` then
`create_response(output_modalities=["audio"])`; iterate `response.audio_chunks()` for the
answer's audio as it is made (and the response itself for its transcript):

    await client.update_session(output_modalities=["audio"])
    await client.append_audio(pcm)                   # the user's question, in chunks as it comes
    response = await client.next_response()          # started by the server's VAD
    async for chunk in response.audio_chunks():
        play(chunk)
    print(client.transcripts.get_nowait(), "->", response.text)
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import mimetypes
from collections import deque
from pathlib import Path

import websockets


def image_part(image: str | Path | bytes, mime_type: str | None = None) -> dict:
    """An `input_image` content part from a file or encoded bytes (PNG, JPEG, WEBP...)."""
    if isinstance(image, (str, Path)):
        mime_type = mime_type or mimetypes.guess_type(str(image))[0] or "image/png"
        image = Path(image).read_bytes()
    url = f"data:{mime_type or 'image/png'};base64,{base64.b64encode(image).decode()}"
    return {"type": "input_image", "image_url": url}


def audio_part(pcm16: bytes) -> dict:
    """An `input_audio` content part: 16-bit mono PCM in the session's input format (24 kHz)."""
    return {"type": "input_audio", "audio": base64.b64encode(pcm16).decode()}


TEXT_DELTAS = ("response.output_text.delta", "response.output_audio_transcript.delta")
# The metadata key by which `create_response` knows its own response among those server VAD
# starts (the server echoes a response.create's metadata in its response.created).
OWN_RESPONSE_KEY = "antiphon_client_request"
# The server's bound on a response's metadata (OpenAI's; frontend/realtime_events.py Metadata, not
# imported: the SDK needs none of the server's packages): the SDK's key takes one of them.
MAX_METADATA_KEYS = 16


class RealtimeError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.param = param


class Response:
    """One streaming response: iterate it for text deltas (a spoken answer's transcript), or
    `audio_chunks()` for its audio; `text`, `audio`, `status`, `usage` when done."""

    def __init__(self, client: "RealtimeClient") -> None:
        self.client = client
        self.id: str | None = None
        self.text = ""
        self.audio = bytearray()
        self._audio: asyncio.Queue = asyncio.Queue()
        self.status: str | None = None
        self.usage: dict | None = None
        self.raw: dict | None = None
        # create_response's tag for it (None: server VAD started it) and its event's id.
        self._tag: str | None = None
        self._event_id: str | None = None
        self._events: asyncio.Queue = asyncio.Queue()
        self.created = asyncio.get_running_loop().create_future()

    def __aiter__(self):
        return self._deltas()

    async def _deltas(self):
        while True:
            event = await self._events.get()
            if isinstance(event, Exception):
                raise event
            if event["type"] in TEXT_DELTAS:
                yield event["delta"]
            elif event["type"] == "response.done":
                return

    async def audio_chunks(self):
        """The answer's audio (16-bit PCM in the session's output format) as it arrives."""
        while True:
            chunk = await self._audio.get()
            if isinstance(chunk, Exception):
                raise chunk
            if chunk is None:
                return
            yield chunk

    async def wait(self) -> "Response":
        async for _ in self:
            pass
        return self

    async def cancel(self) -> None:
        await self.created
        await self.client.send({"type": "response.cancel", "response_id": self.id})

    def _deliver(self, event: dict) -> None:
        if event["type"] in TEXT_DELTAS:
            self.text += event["delta"]
        elif event["type"] == "response.output_audio.delta":
            chunk = base64.b64decode(event["delta"])
            self.audio += chunk
            self._audio.put_nowait(chunk)
            return
        elif event["type"] == "response.done":
            self.raw = event["response"]
            self.status = self.raw["status"]
            self.usage = self.raw.get("usage")
            self._audio.put_nowait(None)
        self._events.put_nowait(event)

    def _fail(self, exc: Exception) -> None:
        self._events.put_nowait(exc)
        self._audio.put_nowait(exc)


class RealtimeClient:
    def __init__(self, url: str = "ws://127.0.0.1:8000/v1/realtime", api_key: str | None = None,
                 open_timeout: float = 30.0) -> None:
        self.url = url
        self.api_key = api_key
        self.open_timeout = open_timeout
        self.session: dict | None = None
        self._ws = None
        self._reader: asyncio.Task | None = None
        self._ids = itertools.count()
        # Our response.create events not yet answered, by the tag their metadata carries.
        self._pending_creates: dict[str, Response] = {}
        # session.updated names no event: matched in order.
        self._pending_session: deque[asyncio.Future] = deque()
        self._by_event_id: dict[str, object] = {}
        self._responses: dict[str, Response] = {}
        self.errors: asyncio.Queue = asyncio.Queue()
        # Voice: responses the server started (server VAD), and the user's turns as heard.
        self.server_responses: asyncio.Queue = asyncio.Queue()
        self.transcripts: asyncio.Queue = asyncio.Queue()

    async def __aenter__(self) -> "RealtimeClient":
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._ws = await websockets.connect(self.url, additional_headers=headers, open_timeout=self.open_timeout,
                                            max_size=None)
        first = json.loads(await self._ws.recv())
        if first["type"] == "error":
            await self._ws.close()
            raise RealtimeError(first["error"]["code"], first["error"]["message"])
        self.session = first["session"]
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()

    async def send(self, event: dict) -> str:
        event_id = f"evt_{next(self._ids)}"
        await self._ws.send(json.dumps({"event_id": event_id, **event}))
        return event_id

    async def update_session(self, **settings) -> dict:
        future = asyncio.get_running_loop().create_future()
        self._pending_session.append(future)
        self._by_event_id[await self.send({"type": "session.update", "session": settings})] = future
        self.session = await future
        return self.session

    async def add_message(self, role: str, content: str | list) -> None:
        """`content`: text, or a list of parts (strings for text, `image_part(...)` for images)."""
        text_type = "output_text" if role == "assistant" else "input_text"
        parts = [content] if isinstance(content, str) else list(content)
        parts = [{"type": text_type, "text": p} if isinstance(p, str) else p for p in parts]
        await self.send({"type": "conversation.item.create",
                         "item": {"type": "message", "role": role, "content": parts}})

    async def append_audio(self, pcm16: bytes, chunk_bytes: int = 4800) -> None:
        """Sends audio to the input buffer in chunks (4800 bytes: 100 ms at 24 kHz)."""
        for start in range(0, len(pcm16), chunk_bytes):
            await self.send({"type": "input_audio_buffer.append",
                             "audio": base64.b64encode(pcm16[start:start + chunk_bytes]).decode()})

    async def commit_audio(self) -> None:
        """Ends the user's turn by hand (sessions with `turn_detection: None`)."""
        await self.send({"type": "input_audio_buffer.commit"})

    async def clear_audio(self) -> None:
        await self.send({"type": "input_audio_buffer.clear"})

    async def next_response(self) -> Response:
        """The next response the server started on its own (server VAD heard a turn end)."""
        response = await self.server_responses.get()
        if isinstance(response, Exception):
            self.server_responses.put_nowait(response)  # every later call learns it too
            raise response
        return response

    async def create_response(self, messages: list[dict] | None = None, **options) -> Response:
        """Add `messages` ({"role", "content"}) to the conversation, then start a response.
        Its metadata carries one more key, OWN_RESPONSE_KEY: a response server VAD starts
        meanwhile is never taken for this one."""
        metadata = options.get("metadata") or {}
        if len(metadata) >= MAX_METADATA_KEYS and OWN_RESPONSE_KEY not in metadata:
            raise ValueError(f"metadata may hold at most {MAX_METADATA_KEYS - 1} keys here: create_response adds "
                             f"{OWN_RESPONSE_KEY!r} to know its own response")
        for message in messages or []:
            await self.add_message(message["role"], message["content"])
        response = Response(self)
        response._tag = f"create_{next(self._ids)}"
        options = {**options, "metadata": {**metadata, OWN_RESPONSE_KEY: response._tag}}
        self._pending_creates[response._tag] = response
        response._event_id = await self.send({"type": "response.create", "response": options})
        self._by_event_id[response._event_id] = response
        await response.created
        return response

    async def _read(self) -> None:
        try:
            async for data in self._ws:
                self._dispatch(json.loads(data))
        except websockets.ConnectionClosed as exc:
            closed = RealtimeError("connection_closed", str(exc))
        else:
            closed = RealtimeError("connection_closed", "the server closed the connection")
        for response in list(self._responses.values()) + list(self._pending_creates.values()):
            if not response.created.done():
                response.created.set_exception(closed)
            response._fail(closed)
        self.server_responses.put_nowait(closed)

    def _dispatch(self, event: dict) -> None:
        kind = event["type"]
        if kind == "session.updated" and self._pending_session:
            self._pending_session.popleft().set_result(event["session"])
        elif kind == "response.created":
            tag = (event["response"].get("metadata") or {}).get(OWN_RESPONSE_KEY)
            response = self._pending_creates.pop(tag, None)
            if response is None:  # started by the server's VAD, not by us
                response = Response(self)
                self.server_responses.put_nowait(response)
            else:
                self._by_event_id.pop(response._event_id, None)
            response.id = event["response"]["id"]
            self._responses[response.id] = response
            response.created.set_result(response.id)
        elif kind.startswith("response.") and "response_id" in event or kind == "response.done":
            response_id = event.get("response_id") or event["response"]["id"]
            response = self._responses.get(response_id)
            if response is not None:
                response._deliver(event)
                if kind == "response.done":
                    del self._responses[response_id]
        elif kind == "conversation.item.input_audio_transcription.completed":
            self.transcripts.put_nowait(event["transcript"])
        elif kind == "error":
            self._on_error(event["error"])

    def _on_error(self, error: dict) -> None:
        exc = RealtimeError(error.get("code"), error.get("message"), error.get("param"))
        target = self._by_event_id.pop(error.get("event_id"), None)
        if isinstance(target, Response) and not target.created.done():
            self._pending_creates.pop(target._tag, None)
            target.created.set_exception(exc)
        elif isinstance(target, asyncio.Future) and not target.done():
            self._pending_session.remove(target)
            target.set_exception(exc)
        else:
            self.errors.put_nowait(exc)
