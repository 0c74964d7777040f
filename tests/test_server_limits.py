"""Server limits: API key, Origin, global concurrency, idle timeout, and clean shutdown."""

import asyncio
import json
import os
import subprocess

import pytest
import websockets

from frontend.client import RealtimeClient, RealtimeError
from tests.server_harness import ServerProcess, get_json, post_json

KEY = "s3cret-key"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    process = ServerProcess(tiny_llama, "--api-key", KEY, "--allowed-origin", "http://ok.example",
                            "--max-num-seqs", "1", "--max-waiting-requests", "0", "--idle-timeout", "1", "--ws-compression",
                            log_dir=tmp_path_factory.mktemp("logs"))
    yield process
    assert process.stop() == 0, process.log_text()


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_http_needs_the_api_key(server):
    for headers in ({}, auth("wrong")):
        status, body = post_json(server.url + "/v1/chat/completions", {"messages": HELLO}, headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert get_json(server.url + "/v1/models", auth("wrong"))[0] == 401
    status, body = post_json(server.url + "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}, auth())
    assert status == 200, body


async def test_websocket_with_a_wrong_key_gets_an_error_and_is_closed(server):
    with pytest.raises(RealtimeError) as error:
        async with RealtimeClient(server.ws_url, api_key="wrong"):
            pass
    assert error.value.code == "invalid_api_key"
    async with RealtimeClient(server.ws_url, api_key=KEY) as client:
        assert client.session["object"] == "realtime.session"


async def test_websocket_compression_when_enabled(server):
    async with RealtimeClient(server.ws_url, api_key=KEY) as client:
        assert "permessage-deflate" in client._ws.response.headers.get("Sec-WebSocket-Extensions", "")
        await client.update_session(temperature=0, max_output_tokens=3)
        response = await (await client.create_response(HELLO)).wait()
        assert response.usage["output_tokens"] == 3 and response.text


async def test_browser_key_subprotocol_and_origin_check(server):
    subprotocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
    async with websockets.connect(server.ws_url, subprotocols=subprotocols, origin="http://ok.example") as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(await ws.recv())["type"] == "session.created"
    own_origin = f"http://127.0.0.1:{server.port}"
    async with websockets.connect(server.ws_url, subprotocols=subprotocols, origin=own_origin) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
    async with websockets.connect(server.ws_url, subprotocols=subprotocols, origin="http://evil.example") as ws:
        event = json.loads(await ws.recv())
        assert event["type"] == "error" and event["error"]["code"] == "origin_not_allowed"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1008


async def test_over_the_global_limit_is_a_clear_error_not_a_hang(server):
    async with RealtimeClient(server.ws_url, api_key=KEY) as client:
        await client.update_session(temperature=0)
        long = await client.create_response([{"role": "user", "content": "again"}])
        status, body = await asyncio.to_thread(post_json, server.url + "/v1/chat/completions",
                                               {"messages": HELLO, "max_tokens": 2}, auth())
        assert status == 429 and body["error"]["code"] == "too_many_requests"
        await long.cancel()
        await long.wait()
    status, body = await asyncio.to_thread(post_json, server.url + "/v1/chat/completions",
                                           {"messages": HELLO, "max_tokens": 2}, auth())
    assert status == 200


async def test_idle_connection_is_closed(server):
    async with websockets.connect(server.ws_url, additional_headers=auth()) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        event = json.loads(await asyncio.wait_for(ws.recv(), timeout=10))
        assert event["error"]["code"] == "idle_timeout"
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), timeout=10)


def test_ctrl_c_leaves_no_worker_behind(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama, log_dir=tmp_path)
    workers = server.worker_pids("decoder") + server.worker_pids("encoder")
    assert len(workers) == 2
    assert server.stop() == 0, server.log_text()
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"worker {pid} survived"


def test_killing_the_server_takes_its_workers_down(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama, log_dir=tmp_path)
    workers = server.worker_pids("decoder") + server.worker_pids("encoder")
    server.process.kill()
    server.process.wait()
    # Workers ask the kernel to signal them when their parent dies.
    deadline = 50
    while deadline and any(os.path.exists(f"/proc/{pid}") and not _is_zombie(pid) for pid in workers):
        subprocess.run(["sleep", "0.2"])
        deadline -= 1
    assert deadline, "workers outlived a killed server"
    server.stop()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_server_with_async_scheduling_streams_the_offline_greedy_tokens(tiny_llama, tmp_path):
    from engine import LLM, SamplingParams

    expected = LLM(str(tiny_llama), num_kv_blocks=64).chat(HELLO, SamplingParams(temperature=0, max_tokens=30))[0]
    server = ServerProcess(tiny_llama, "--async-scheduling", "on", log_dir=tmp_path)
    try:
        for _ in range(2):  # the second time from the prefix cache
            status, body = post_json(server.url + "/v1/chat/completions", {
                "messages": HELLO, "temperature": 0, "max_tokens": 30, "return_token_ids": True})
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == expected.token_ids
    finally:
        assert server.stop() == 0
