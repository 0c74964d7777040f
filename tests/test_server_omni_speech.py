"""An omni model speaks its own answers through the real server: decoder -> talker process -> client.

With voice on, a tiny Qwen2.5-Omni server runs the model's talker and codec in the talker
process, fed the thinker's rows by the decoder over ZeroMQ. A chat completion with
`modalities ["text", "audio"]` gets the answer's text, its transcript and its audio, streamed
by the codec in chunks; with a seed, its codes are the offline LLM's for the same request (the
talker's sampling drawn after the seed) and its audio is theirs decoded by the same stream (the
codec's noise drawn after the seed too), and Realtime's audio equals HTTP's. Voices are the model's speakers; an
unknown one is refused. A talker killed mid-answer fails the answers it was speaking, text
answers go on, and it comes back.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal

import msgspec
import numpy as np
import pytest

from engine.audio_formats import read_wav
from tests.omni_models import save_tiny_omni
from tests.server_harness import ServerProcess, get_json, post_json, wait_for

# The random talker never says its end code: every answer is MAX_CODES codes long.
MAX_TOKENS, MAX_CODES, SEED = 8, 40, 11
QUESTION = "Say something."


def spoken_body(voice: str = "Chelsie", **extra) -> dict:
    return {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "seed": SEED, "modalities": ["text", "audio"],
            "audio": {"voice": voice, "format": "wav"}, **extra}


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    return save_tiny_omni("qwen2_5_omni", tmp_path_factory.mktemp("omni-speech") / "qwen2_5_omni")


@pytest.fixture(scope="module")
def server(omni, tmp_path_factory):
    process = ServerProcess(omni, "--max-spoken-codes", str(MAX_CODES), log_dir=tmp_path_factory.mktemp("logs"),
                            voice=True)
    yield process
    assert process.stop() == 0, process.log_text()


@pytest.fixture(scope="module")
def offline_answer(omni):
    """The same request, offline: its text and codes, and those codes streamed through the codec."""
    from engine import LLM, SamplingParams
    from engine.adapters.qwen2_5_omni_codec_stream import CodecStream
    from engine.talker_stage import DEFAULT_TALKER_PARAMS

    llm = LLM(str(omni), quantization="none", omni_speech=True)
    out, = llm.chat([{"role": "user", "content": QUESTION}],
                    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=SEED),
                    voice="Chelsie", talker_params=msgspec.structs.replace(DEFAULT_TALKER_PARAMS, seed=SEED,
                                                                           max_tokens=MAX_CODES))
    assert len(out.codec_token_ids) == MAX_CODES
    stage = llm._speech.stage
    stream = CodecStream(stage.codec, stage.spec.speakers["Chelsie"], seed=SEED)
    out.audio = np.concatenate([*(chunk.numpy() for chunk in stream.feed(out.codec_token_ids)),
                                stream.finish().numpy()])
    return out


def test_a_spoken_chat_answer_is_the_offline_llms_streamed(server, offline_answer):
    from engine.audio_formats import to_pcm16

    status, answer = post_json(server.url + "/v1/chat/completions", spoken_body())
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert message["audio"]["transcript"] == offline_answer.text
    samples, rate = read_wav(base64.b64decode(message["audio"]["data"]))
    assert rate == 24000
    expected = to_pcm16(offline_answer.audio).astype(np.float32) / 32767
    assert samples.size == expected.size > 0
    np.testing.assert_allclose(samples, expected, atol=2 / 32767)


def test_voices_are_the_models_speakers(server):
    status, answer = post_json(server.url + "/v1/chat/completions", spoken_body("ethan"))
    assert status == 200, answer
    assert answer["choices"][0]["message"]["audio"]["data"]
    status, answer = post_json(server.url + "/v1/chat/completions", spoken_body("alloy"))
    assert (status, answer["error"]["code"], answer["error"]["param"]) == (400, "invalid_value", "audio.voice")
    assert "Chelsie" in answer["error"]["message"] and "Ethan" in answer["error"]["message"]


def test_speech_endpoint_is_refused_with_an_omni_model(server):
    status, answer = post_json(server.url + "/v1/audio/speech", {"model": "x", "input": "Hello there.",
                                                                 "voice": "Chelsie"})
    assert (status, answer["error"]["code"]) == (400, "unsupported_model"), answer


async def test_realtime_speaks_as_http_does(server):
    from frontend.client import RealtimeClient

    status, plain = post_json(server.url + "/v1/chat/completions", spoken_body(audio={"voice": "Chelsie",
                                                                                      "format": "pcm16"}))
    assert status == 200, plain
    async with RealtimeClient(server.ws_url) as client:
        session = await client.update_session(temperature=0, max_output_tokens=MAX_TOKENS, seed=SEED,
                                              output_modalities=["audio"])
        assert session["audio"]["output"]["voice"] == "Chelsie"  # the model's first speaker
        response = await client.create_response([{"role": "user", "content": QUESTION}])
        chunks = [chunk async for chunk in response.audio_chunks()]
        await response.wait()
    # Streamed: the tiny codec's stream yields a chunk at 16 and at 32 codes, the rest at the end.
    assert len(chunks) == 3
    audio = b"".join(chunks)
    assert response.status == "incomplete"  # max_output_tokens
    assert response.text == plain["choices"][0]["message"]["audio"]["transcript"]
    assert audio == base64.b64decode(plain["choices"][0]["message"]["audio"]["data"])


async def test_an_unknown_realtime_voice_or_a_spoken_tool_call_is_an_error_event(server):
    import websockets

    async with websockets.connect(server.ws_url) as ws:
        async def next_of(kind):
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == kind:
                    return event
        await next_of("session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"output": {"voice": "alloy"}}}}))
        error = await next_of("error")
        assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", "session.audio.output.voice")
        # Its talker would speak a call's JSON: a spoken answer that may call tools is refused.
        tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
        await ws.send(json.dumps({"type": "response.create", "response": {
            "output_modalities": ["audio"], "tools": [tool], "input": []}}))
        error = await next_of("error")
        assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", "response.tools"), error


def test_a_killed_talker_fails_its_answers_and_comes_back(server):
    # Frozen first, so that the answer is surely in flight when the talker dies.
    talker, = server.worker_pids("talker")
    os.kill(talker, signal.SIGSTOP)

    async def race():
        loop = asyncio.get_running_loop()
        spoken = loop.run_in_executor(None, post_json, server.url + "/v1/chat/completions", spoken_body())
        await asyncio.sleep(1.0)
        os.kill(talker, signal.SIGKILL)
        text = await loop.run_in_executor(None, post_json, server.url + "/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        return await spoken, text

    (spoken_status, spoken), (text_status, text) = asyncio.run(race())
    assert (spoken_status, spoken["error"]["code"]) == (503, "voice_unavailable"), spoken
    assert text_status == 200, text
    assert wait_for(lambda: get_json(server.url + "/health")[1].get("voice") == "ready", timeout=120)
    assert server.worker_pids("talker") != [talker]
    status, answer = post_json(server.url + "/v1/chat/completions", spoken_body())
    assert status == 200, answer
    assert answer["choices"][0]["message"]["audio"]["data"]


async def test_a_cancelled_spoken_response_stops_and_the_next_one_speaks(server):
    from frontend.client import RealtimeClient

    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0, max_output_tokens=200, seed=SEED, output_modalities=["audio"])
        response = await client.create_response([{"role": "user", "content": QUESTION}])
        await response.cancel()  # as soon as it is created: its speech is surely in flight
        await response.wait()
        assert response.status == "cancelled"
        await client.update_session(max_output_tokens=MAX_TOKENS)
        again = await client.create_response([{"role": "user", "content": QUESTION}])
        audio = b"".join([chunk async for chunk in again.audio_chunks()])
        await again.wait()
    assert again.status == "incomplete" and audio
