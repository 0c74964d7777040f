"""The serving benchmarks' HTTP client (benchmarks/http_client.py) against a scripted server:
what it sends, and what it times and counts from what comes back."""

from __future__ import annotations

import asyncio
import json

from benchmarks.http_client import read_head, send_request, sse_events, stream_chat


class ScriptedServer:
    """Reads one request head and body, then writes `script`'s pieces, pausing where a piece is
    a number of seconds; closes after the last one."""

    def __init__(self, script: list[bytes | float]) -> None:
        self.script = script
        self.heads: list[str] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        self.heads.append(head)
        length = next((int(line.split(":")[1]) for line in head.split("\r\n")
                       if line.lower().startswith("content-length:")), 0)
        await reader.readexactly(length)
        for piece in self.script:
            if isinstance(piece, float):
                await asyncio.sleep(piece)
            else:
                writer.write(piece)
                await writer.drain()
        writer.close()


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(payload: dict | str) -> bytes:
    event = f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
    return f"{len(event):x}\r\n".encode() + event + b"\r\n"


def delta(content: str | None = None, token_ids: list[int] | None = None, finish: str | None = None) -> dict:
    body = {} if content is None else {"content": content}
    if token_ids is not None:
        body["token_ids"] = token_ids
    return {"choices": [{"index": 0, "delta": body, "finish_reason": finish}]}


async def test_stream_chat_times_each_chunk_with_token_ids_from_before_connecting():
    script = [SSE_HEAD, chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}),
              0.05, chunk(delta("ab", [1, 2])), 0.02, chunk(delta("c", [3])), chunk(delta(finish="length")),
              chunk("[DONE]"), b"0\r\n\r\n"]
    async with ScriptedServer(script) as url:
        result = await stream_chat(url, {"messages": [], "stream": True}, api_key=None)
    assert result.error is None
    assert len(result.token_times) == 2 and result.output_tokens == 3
    assert result.text == "abc" and result.finish == "length"
    assert result.ttft >= 0.05  # the role-only chunk before it carries no token
    assert result.itls[0] >= 0.02


async def test_stream_chat_keeps_a_refusal_with_its_body():
    body = json.dumps({"error": {"code": "too_many_requests", "message": "busy"}}).encode()
    script = [b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: %d\r\n\r\n" % len(body) + body]
    async with ScriptedServer(script) as url:
        result = await stream_chat(url, {"messages": []}, api_key=None)
    assert result.error.startswith("http 429: ") and "too_many_requests" in result.error
    assert not result.token_times


async def test_stream_chat_counts_a_stream_without_done_as_failed():
    complete_but_no_done = [SSE_HEAD, chunk(delta("a", [1])), b"0\r\n\r\n"]
    cut_off = [SSE_HEAD, chunk(delta("a", [1]))]
    for script, error in ((complete_but_no_done, "the stream ended without [DONE]"),
                          (cut_off, "the connection closed mid-answer")):
        async with ScriptedServer(script) as url:
            result = await stream_chat(url, {"messages": []}, api_key=None)
        assert result.error == error
        assert result.output_tokens == 1


async def test_stream_chat_sends_its_key_host_and_body_length():
    server = ScriptedServer([SSE_HEAD, chunk("[DONE]"), b"0\r\n\r\n"])
    async with server as url:
        await stream_chat(url, {"messages": []}, api_key="secret")
    lines = server.heads[0].split("\r\n")
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    assert f"Host: {url.removeprefix('http://')}" in lines
    assert "Authorization: Bearer secret" in lines and "Connection: close" in lines
    assert f"Content-Length: {len(json.dumps({'messages': []}))}" in lines


async def test_get_has_no_body_headers_and_reads_an_unchunked_event_stream():
    body = b": keep-alive comment\n\ndata: {\"a\": 1}\n\ndata: [DONE]\n\n"
    server = ScriptedServer([b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n", body[:20], 0.01,
                             body[20:]])
    async with server as url:
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await send_request("127.0.0.1", port, "GET", "/events", content_type=None)
        try:
            status, headers = await read_head(reader)
            events = [event async for event in sse_events(reader, headers)]
        finally:
            writer.close()
    assert status == 200 and events == ['{"a": 1}', "[DONE]"]
    assert server.heads[0] == f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
