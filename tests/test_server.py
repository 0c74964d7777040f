"""The real server (frontend + decoder + encoder processes) over HTTP, raw WebSockets and the SDK."""

import asyncio
import http.client
import json

import pytest
import websockets

from engine import LLM, SamplingParams
from frontend.client import RealtimeClient, RealtimeError
from tests.server_harness import ServerProcess, get_json, post_json, request, wait_for

CONVERSATION = [{"role": "user", "content": "hello"}]
# Greedy on the tiny model, this answer runs for ~290 tokens: long enough to cancel mid-way.
LONG_PROMPT = [{"role": "user", "content": "again"}]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    process = ServerProcess(tiny_llama, "--max-concurrent-per-connection", "3", "--max-message-bytes", "4096",
                            log_dir=tmp_path_factory.mktemp("logs"))
    yield process
    assert process.stop() == 0, process.log_text()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=256)


def greedy_offline(offline, conversation, max_tokens):
    return offline.chat(conversation, SamplingParams(temperature=0, max_tokens=max_tokens))[0]


def blocks_freed(server) -> bool:
    return server.metric("antiphon_kv_blocks_used") == 0 and server.metric("antiphon_requests_in_flight") == 0


# ---- HTTP -------------------------------------------------------------------------------

def test_chat_completion_equals_offline_greedy_tokens(server, offline):
    expected = greedy_offline(offline, CONVERSATION, 24)
    status, body = post_json(server.url + "/v1/chat/completions", {
        "model": "tiny", "messages": CONVERSATION, "temperature": 0, "max_tokens": 24, "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == expected.token_ids
    assert choice["message"]["content"] == expected.text
    assert choice["finish_reason"] == expected.finish_reason
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)


def test_streamed_sse_equals_the_plain_answer_and_ends_with_usage(server, offline):
    expected = greedy_offline(offline, CONVERSATION, 24)
    status, text = request("POST", server.url + "/v1/chat/completions", {
        "messages": CONVERSATION, "temperature": 0, "max_tokens": 24, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["delta"].get("token_ids", [])]
    content = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
    assert tokens == expected.token_ids and content == expected.text
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(expected.token_ids)
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_the_decoder_warms_up_before_it_says_ready(server):
    log = server.log_path.read_text()
    assert "warmed up in" in log and log.index("warmed up in") < log.index("decoder ready")


def test_models_health_and_metrics(server):
    assert get_json(server.url + "/health") == (200, {"status": "ok", "voice": "voice is off (--no-voice)"})
    status, models = get_json(server.url + "/v1/models")
    assert status == 200 and models["data"][0]["object"] == "model"
    status, text = request("GET", server.url + "/metrics")
    for name in ("antiphon_time_to_first_token_seconds_bucket", "antiphon_inter_token_latency_seconds_count",
                 "antiphon_prefix_cache_hits_total", "antiphon_kv_blocks_used", "antiphon_requests_waiting"):
        assert name in text


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_value"),
    (json.dumps({"messages": []}).encode(), 400, "empty_conversation"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": CONVERSATION, "temperature": -1}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": CONVERSATION, "max_tokens": 0}).encode(), 400, "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode(), 413, "request_too_large"),
])
def test_bad_http_requests_get_clear_errors(server, body, status, code):
    got, text = request("POST", server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert got == status
    assert json.loads(text)["error"]["code"] == code
    assert get_json(server.url + "/health")[0] == 200


def test_prompt_over_the_limit_is_rejected(server):
    status, body = post_json(server.url + "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "word " * 700}], "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "prompt_too_long"


def test_client_disconnect_mid_stream_frees_kv_blocks(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps({
        "messages": CONVERSATION, "max_tokens": 450, "ignore_eos": True, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event: the stream is running
    assert server.metric("antiphon_kv_blocks_used") > 0
    connection.close()
    assert wait_for(lambda: blocks_freed(server)), "blocks still held after the client left"


# ---- Realtime ----------------------------------------------------------------------------

async def test_realtime_sdk_streams_the_offline_greedy_answer(server, offline):
    first = greedy_offline(offline, CONVERSATION, 20)
    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0, max_output_tokens=20)
        response = await client.create_response(CONVERSATION)
        deltas = [d async for d in response]
        assert "".join(deltas) == response.text == first.text
        assert response.status == ("completed" if first.finish_reason == "stop" else "incomplete")
        assert response.usage["output_tokens"] == len(first.token_ids)
        # The answer joins the conversation: the next turn continues it.
        follow_up = [{"role": "user", "content": "again"}]
        second = await client.create_response(follow_up)
        await second.wait()
        expected = greedy_offline(offline, CONVERSATION + [{"role": "assistant", "content": first.text}]
                                  + follow_up, 20)
        assert second.text == expected.text
        assert second.usage["input_token_details"]["cached_tokens"] > 0


async def test_two_connections_stream_concurrently(server, offline):
    expected = greedy_offline(offline, LONG_PROMPT, 120)

    async def run():
        async with RealtimeClient(server.ws_url) as client:
            await client.update_session(temperature=0, max_output_tokens=120)
            response = await client.create_response(LONG_PROMPT)
            stamps = []
            async for _ in response:
                stamps.append(asyncio.get_running_loop().time())
            return response.text, stamps

    (text_a, stamps_a), (text_b, stamps_b) = await asyncio.gather(run(), run())
    assert text_a == text_b == expected.text
    # Interleaved, not one after the other.
    assert stamps_a[0] < stamps_b[-1] and stamps_b[0] < stamps_a[-1]


async def test_cancel_ends_the_response_and_frees_blocks(server):
    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0)
        response = await client.create_response(LONG_PROMPT)
        async for _ in response:
            break
        await response.cancel()
        await response.wait()
        assert response.status == "cancelled"
        assert 0 < response.usage["output_tokens"] < 200
        assert await asyncio.to_thread(wait_for, lambda: blocks_freed(server))
        # The connection carries on with a new response.
        again = await client.create_response([{"role": "user", "content": "hello"}])
        await again.wait()
        assert again.status in ("completed", "incomplete")


async def test_websocket_disconnect_mid_response_frees_blocks(server):
    websocket = await websockets.connect(server.ws_url)
    await websocket.recv()  # session.created
    for event in ({"type": "session.update", "session": {"temperature": 0}},
                  {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                "content": [{"type": "input_text", "text": "again"}]}},
                  {"type": "response.create"}):
        await websocket.send(json.dumps(event))
    while json.loads(await websocket.recv())["type"] != "response.output_text.delta":
        pass
    await websocket.close()
    assert await asyncio.to_thread(wait_for, lambda: blocks_freed(server))


async def test_websocket_compression_is_declined_by_default(server):
    # Compressing every small delta costs CPU on both ends; by default the server declines the
    # permessage-deflate offer that websockets clients (and browsers) make.
    async with websockets.connect(server.ws_url, compression="deflate") as websocket:
        assert websocket.response.headers.get("Sec-WebSocket-Extensions") is None
        assert json.loads(await websocket.recv())["type"] == "session.created"


async def test_bad_realtime_events_get_error_events_and_the_connection_survives(server):
    async with websockets.connect(server.ws_url) as websocket:
        assert json.loads(await websocket.recv())["type"] == "session.created"

        async def error_code(raw: str) -> str:
            await websocket.send(raw)
            event = json.loads(await websocket.recv())
            assert event["type"] == "error", event
            return event["error"]["code"]

        assert await error_code("{nope") == "invalid_json"
        assert await error_code(json.dumps({"type": "no.such.event"})) == "unknown_event_type"
        assert await error_code(json.dumps({"no": "type"})) == "invalid_event"
        assert await error_code("x" * 5000) == "message_too_large"
        assert await error_code(json.dumps({"type": "session.update", "session": {"temperature": -3}})) \
            == "invalid_value"
        assert await error_code(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}})) \
            == "unsupported_content_type"
        assert await error_code(json.dumps({"type": "response.cancel"})) == "response_cancel_not_active"
        # Still serving: a normal exchange works on the same connection.
        await websocket.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}}))
        assert json.loads(await websocket.recv())["type"] == "conversation.item.added"
        await websocket.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 4}}))
        kinds = []
        while not kinds or kinds[-1] != "response.done":
            kinds.append(json.loads(await websocket.recv())["type"])
        assert kinds[0] == "response.created" and "response.output_text.done" in kinds


async def test_per_connection_response_limit(server):
    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0)
        running = [await client.create_response(LONG_PROMPT, conversation="none", input=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"}]}])
            for _ in range(3)]
        with pytest.raises(RealtimeError) as error:
            await client.create_response([], conversation="none", input=[
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
        assert error.value.code == "too_many_responses"
        for response in running:
            await response.cancel()
            await response.wait()


async def test_second_conversation_response_while_one_runs_is_refused(server):
    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0)
        first = await client.create_response(LONG_PROMPT)
        with pytest.raises(RealtimeError) as error:
            await client.create_response()
        assert error.value.code == "conversation_already_has_active_response"
        await first.cancel()
        await first.wait()


# ---- crashes (last: the server restarts its decoder) ------------------------------------------

async def test_killed_decoder_ends_the_stream_with_an_error_and_health_says_so(server):
    import os
    import signal

    async with websockets.connect(server.ws_url) as websocket:
        await websocket.recv()
        for event in ({"type": "session.update", "session": {"temperature": 0}},
                      {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                          {"type": "input_text", "text": "again"}]}},
                      {"type": "response.create"}):
            await websocket.send(json.dumps(event))
        while json.loads(await websocket.recv())["type"] != "response.output_text.delta":
            pass
        (decoder,) = server.worker_pids("decoder")
        os.kill(decoder, signal.SIGKILL)
        events = []
        while not events or events[-1]["type"] != "response.done":
            events.append(json.loads(await websocket.recv()))
        errors = [e for e in events if e["type"] == "error"]
        assert errors and errors[0]["error"]["code"] == "engine_error"
        assert events[-1]["response"]["status"] == "failed"
        status, health = get_json(server.url + "/health")
        assert status == 503 and "decoder" in health["reason"]
    # The decoder is restarted and the server serves again.
    assert await asyncio.to_thread(wait_for, lambda: get_json(server.url + "/health")[0] == 200, 120)
    status, body = post_json(server.url + "/v1/chat/completions", {"messages": CONVERSATION, "max_tokens": 3})
    assert status == 200, body
