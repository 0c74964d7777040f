"""The HTTP client of the serving benchmarks (serve.py, structured_output.py, soak.py,
mixed_soak.py): one request per connection over raw asyncio streams, its status and headers,
the `data:` payloads of a server-sent event stream, and an abrupt drop (a RST).

Raw streams rather than an HTTP library, so what is timed is the server: no connection pool,
no retries, no buffering between a chunk's arrival and its timestamp. Every request says
`Connection: close`, so an answer that is not chunked ends at EOF.

`stream_chat` is the streamed chat completion of serve.py and structured_output.py on top of
it; `RequestResult` is its record, which serve.py's offline runs fill the same way.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlparse


async def send_request(host: str, port: int, method: str, path: str, body: bytes = b"", *,
                       content_type: str | None = "application/json", api_key: str | None = None,
                       local_addr: str | None = None,
                       early_answer: bool = False) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connects and sends one request; the caller reads the answer and closes the writer.

    `local_addr`: the client's own source address. `early_answer`: the server may answer and
    close before it has read the whole body (a refusal of a large one), so a failed write is
    ignored and the answer is read as usual; otherwise the write's error is raised.
    """
    reader, writer = await asyncio.open_connection(host, port, local_addr=(local_addr, 0) if local_addr else None)
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    if content_type:
        head.append(f"Content-Type: {content_type}")
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    if method != "GET":
        head.append(f"Content-Length: {len(body)}")
    head.append("Connection: close")
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
    except ConnectionError:
        if not early_answer:
            writer.close()
            raise
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the headers (names lower-cased). A connection that closes before the
    head ends raises asyncio.IncompleteReadError."""
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    return int(lines[0].split()[1]), headers


async def sse_events(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[str]:
    """The `data:` payloads of an SSE body (chunked or not), each as soon as the piece of the
    body that completes it has arrived. A chunked body cut off before its last chunk raises
    asyncio.IncompleteReadError."""
    chunked = headers.get("transfer-encoding") == "chunked"
    buffer = b""
    while True:
        if chunked:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                return
            data = (await reader.readexactly(size + 2))[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                return
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:].decode()


def abort(writer: asyncio.StreamWriter) -> None:
    """Drop the connection at once: a RST, no FIN and no close frame."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class RequestResult:
    """One streamed request's timings (time.perf_counter), tokens and text."""

    sent: float
    token_times: list[float] = field(default_factory=list)  # one per chunk that carried tokens
    output_tokens: int = 0
    text: str = ""
    finish: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return 0.0
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)


async def stream_chat(url: str, body: dict, api_key: str | None) -> RequestResult:
    """One streamed /v1/chat/completions. `sent` is taken just before connecting; a token time
    when a chunk carrying token ids (the body asks for `return_token_ids`) arrives, and its
    tokens are counted by those ids. A refusal, an error event or a stream that ends without
    [DONE] is kept in `error`, with the answer's body for a refusal."""
    target = urlparse(url)
    payload = json.dumps(body).encode()
    result = RequestResult(sent=time.perf_counter())
    try:
        reader, writer = await send_request(target.hostname, target.port, "POST", "/v1/chat/completions", payload,
                                            api_key=api_key)
    except OSError as error:
        result.error = f"could not connect: {error}"
        return result
    try:
        status, headers = await read_head(reader)
        if status != 200:
            result.error = f"http {status}: {(await reader.read()).decode(errors='replace')[:500]}"
            return result
        async for event in sse_events(reader, headers):
            if event == "[DONE]":
                return result
            chunk = json.loads(event)
            if "error" in chunk:
                result.error = chunk["error"]["message"]
                return result
            for choice in chunk["choices"]:
                if tokens := choice["delta"].get("token_ids"):
                    result.token_times.append(time.perf_counter())
                    result.output_tokens += len(tokens)
                result.text += choice["delta"].get("content") or ""
                result.finish = choice.get("finish_reason") or result.finish
        result.error = "the stream ended without [DONE]"
    except asyncio.IncompleteReadError:
        result.error = "the connection closed mid-answer"
    except OSError as error:  # reset mid-answer: one failed request, not a failed round
        result.error = f"connection error: {error}"
    finally:
        writer.close()
    return result
