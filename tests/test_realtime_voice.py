"""The Realtime voice loop with the real models: a spoken question in real-time-sized chunks,
server VAD, the transcript, a spoken answer whose audio says its transcript, manual commits,
barge-in, G.711, and bad audio input."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal

import numpy as np
import pytest
import websockets

from engine.audio_formats import encode_audio, write_wav
from tests.server_harness import request
from tests.spoken import said_naturally, transcript_similarity, words

# Said by the Piper voice, tiny.en heard this one right in every variant tried (8 of 8, and
# through the server-VAD path 6 of 6); "What color is the sky?" only in 5 of 8.
QUESTION = "What is the capital of France?"
CHUNK_S = 0.1


async def send(ws, event: dict) -> None:
    await ws.send(json.dumps(event))


async def events_until(ws, last: str, timeout: float = 120.0, collect: list | None = None) -> list[dict]:
    """Every event up to and including the first of type `last`."""
    seen = collect if collect is not None else []
    async with asyncio.timeout(timeout):
        while True:
            event = json.loads(await ws.recv())
            seen.append(event)
            if event["type"] == last:
                return seen


async def speak_into(ws, samples: np.ndarray, rate: int = 24000, fmt: str = "audio/pcm",
                     real_time: bool = True) -> None:
    step = int(CHUNK_S * rate)
    for start in range(0, len(samples), step):
        chunk = encode_audio(samples[start:start + step], fmt)
        await send(ws, {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
        if real_time:
            await asyncio.sleep(CHUNK_S)


def padded(samples: np.ndarray, rate: int, before_s: float = 0.5, after_s: float = 1.0) -> np.ndarray:
    return np.concatenate([np.zeros(int(before_s * rate), np.float32), samples,
                           np.zeros(int(after_s * rate), np.float32)])


def answer_audio(events: list[dict]) -> np.ndarray:
    pcm = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768


def transcribe_over_http(server, samples: np.ndarray, rate: int) -> str:
    from tests.test_server_voice import multipart

    body, headers = multipart({"model": "whisper-1", "response_format": "text"}, write_wav(samples, rate))
    status, text = request("POST", server.url + "/v1/audio/transcriptions", body, headers, timeout=120)
    assert status == 200, text
    return text.strip()


async def test_a_spoken_question_gets_a_spoken_answer_with_server_vad(voice_server):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {
            "output_modalities": ["audio"], "instructions": "Answer in one short sentence.",
            "max_output_tokens": 40, "temperature": 0,
            "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}}}})
        updated = (await events_until(ws, "session.updated"))[-1]["session"]
        assert updated["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 300
        events: list[dict] = []
        speaker = asyncio.create_task(speak_into(ws, padded(said_naturally(QUESTION, 24000), 24000)))
        await events_until(ws, "response.done", collect=events)
        await speaker
    types = [e["type"] for e in events]
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed",
             "response.created", "response.output_audio.delta", "response.output_audio.done",
             "response.output_audio_transcript.done", "response.done"]
    missing = [t for t in order if t not in types]
    assert not missing, (missing, types)
    firsts = [types.index(t) for t in order]
    assert firsts == sorted(firsts), types
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    assert 0 < started["audio_start_ms"] < 700  # the speech began 0.5 s in; 300 ms of padding before it
    transcript = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert words(transcript["transcript"]) == words(QUESTION)
    done = events[-1]["response"]
    assert done["status"] in ("completed", "incomplete") and done["output_modalities"] == ["audio"]
    # Usage meters the audio: one token per 100 ms heard (the turn) and spoken (the answer).
    audio_tokens_out = done["usage"]["output_token_details"]["audio_tokens"]
    assert abs(audio_tokens_out - len(answer_audio(events)) / 2400) <= 1
    assert 15 <= done["usage"]["input_token_details"]["audio_tokens"] <= 40
    said = next(e for e in events if e["type"] == "response.output_audio_transcript.done")["transcript"]
    assert "paris" in said.lower()
    assert said == "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    # The audio says its transcript: run it back through the recognizer.
    heard = transcribe_over_http(voice_server, answer_audio(events), 24000)
    assert transcript_similarity(heard, said) > 0.8, (heard, said)


async def test_manual_commit_without_vad_then_a_text_answer(voice_server):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}},
                                                              "max_output_tokens": 20, "temperature": 0}})
        await events_until(ws, "session.updated")
        await speak_into(ws, padded(said_naturally(QUESTION, 24000), 24000), real_time=False)
        await send(ws, {"type": "input_audio_buffer.commit"})
        events = await events_until(ws, "conversation.item.input_audio_transcription.completed")
        types = [e["type"] for e in events]
        assert "input_audio_buffer.speech_started" not in types  # no VAD: nothing but the commit
        assert types[:2] == ["input_audio_buffer.committed", "conversation.item.added"]
        assert words(events[-1]["transcript"]) == words(QUESTION)
        await send(ws, {"type": "response.create"})
        events = await events_until(ws, "response.done")
        answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert "paris" in answer.lower()


async def test_a_session_goes_on_reading_while_the_encoder_cannot_hear_its_turn(voice_server):
    """A turn waiting on a stopped (or busy) encoder holds up neither the socket's pings nor
    the session's other events; the turn goes on once the encoder is back."""
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}},
                                                              "max_output_tokens": 20, "temperature": 0}})
        await events_until(ws, "session.updated")
        await speak_into(ws, padded(said_naturally(QUESTION, 24000), 24000), real_time=False)
        events: list[dict] = []
        encoder = voice_server.worker_pids("encoder")
        for pid in encoder:
            os.kill(pid, signal.SIGSTOP)
        try:
            await send(ws, {"type": "input_audio_buffer.commit"})
            await events_until(ws, "conversation.item.added", timeout=10, collect=events)
            await send(ws, {"type": "session.update", "session": {"max_output_tokens": 24}})
            await events_until(ws, "session.updated", timeout=5, collect=events)
            await asyncio.wait_for(await ws.ping(), 5)
            await send(ws, {"type": "response.create"})
            await asyncio.sleep(0.5)
        finally:
            for pid in encoder:
                os.kill(pid, signal.SIGCONT)
        await events_until(ws, "response.done", collect=events)
    types = [e["type"] for e in events]
    assert "conversation.item.input_audio_transcription.completed" not in types[:types.index("session.updated")]
    assert types.index("conversation.item.input_audio_transcription.completed") < types.index("response.created")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["response"]["status"] in ("completed", "incomplete") and "paris" in answer.lower()


async def test_speech_during_a_spoken_answer_cancels_it(voice_server):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {"output_modalities": ["audio"],
                                                              "max_output_tokens": 300}})
        await events_until(ws, "session.updated")
        await send(ws, {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Tell me a long story about a dragon."}]}})
        await send(ws, {"type": "response.create"})
        before = await events_until(ws, "response.output_audio.delta")
        response_id = next(e for e in before if e["type"] == "response.created")["response"]["id"]
        events: list[dict] = []
        speaker = asyncio.create_task(speak_into(ws, padded(said_naturally("Stop, please.", 24000), 24000, 0.2, 0.2)))
        await events_until(ws, "input_audio_buffer.speech_started", collect=events)
        await events_until(ws, "response.done", timeout=10, collect=events)
        speaker.cancel()
        done = events[-1]["response"]
        assert done["id"] == response_id and done["status"] == "cancelled"
        # Truncating the answer at what was heard keeps only those words.
        item_id = done["output"][0]["id"]
        await send(ws, {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                        "audio_end_ms": 0})
        truncated = await events_until(ws, "conversation.item.truncated")
        assert truncated[-1]["item_id"] == item_id
        await send(ws, {"type": "conversation.item.retrieve", "item_id": item_id})
        retrieved = (await events_until(ws, "conversation.item.retrieved"))[-1]["item"]
        assert retrieved["content"][0]["transcript"] == ""


async def test_g711_in_and_out(voice_server):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {
            "output_modalities": ["audio"], "max_output_tokens": 12, "temperature": 0,
            "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                      "output": {"format": {"type": "audio/pcma"}}}}})
        await events_until(ws, "session.updated")
        await speak_into(ws, padded(said_naturally(QUESTION, 8000), 8000), rate=8000, fmt="audio/pcmu", real_time=False)
        await send(ws, {"type": "input_audio_buffer.commit"})
        done = await events_until(ws, "conversation.item.input_audio_transcription.completed")
        assert words(done[-1]["transcript"]) == words(QUESTION)
        await send(ws, {"type": "response.create"})
        events = await events_until(ws, "response.done")
        alaw = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
        assert len(alaw) > 8000 * 0.3  # one byte per sample at 8 kHz


@pytest.mark.parametrize("event, code", [
    ({"type": "input_audio_buffer.append", "audio": "not base64!!"}, "invalid_audio"),
    ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x00\x01\x02").decode()}, "invalid_audio"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/mp3"}}}}},
     "invalid_value"),
    ({"type": "session.update", "session": {"output_modalities": ["text", "audio"]}}, "invalid_value"),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8000}}}}},
     "invalid_value"),
])
async def test_bad_audio_events_get_an_error_and_the_session_goes_on(voice_server, event, code):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await events_until(ws, "session.updated")
        await send(ws, event)
        error = (await events_until(ws, "error"))[-1]["error"]
        assert error["code"] == code, error
        await send(ws, {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})
        await events_until(ws, "conversation.item.added")


async def test_silence_only_commit_is_an_error_and_leaves_no_item(voice_server):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await events_until(ws, "session.updated")
        await speak_into(ws, np.zeros(24000, np.float32), real_time=False)
        await send(ws, {"type": "input_audio_buffer.commit"})
        events = await events_until(ws, "error")
        types = [e["type"] for e in events]
        assert "conversation.item.input_audio_transcription.failed" in types
        assert "conversation.item.deleted" in types
        assert events[-1]["error"]["code"] == "input_audio_no_speech"


async def test_the_buffer_limit_is_enforced(voice_server):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await events_until(ws, "session.updated")
        second = base64.b64encode(np.zeros(24000, "<i2").tobytes()).decode()
        for _ in range(21):  # the server was started with --max-audio-buffer-seconds 20
            await send(ws, {"type": "input_audio_buffer.append", "audio": second})
        error = (await events_until(ws, "error"))[-1]["error"]
        assert error["code"] == "input_audio_buffer_full"
        await send(ws, {"type": "input_audio_buffer.clear"})
        await events_until(ws, "input_audio_buffer.cleared")


async def test_beta_audio_setting_names_are_accepted(voice_server):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {
            "modalities": ["audio"], "input_audio_format": "g711_ulaw", "output_audio_format": "g711_alaw",
            "turn_detection": None, "input_audio_transcription": {"model": "whisper-1"}, "voice": "verse"}})
        session = (await events_until(ws, "session.updated"))[-1]["session"]
    audio = session["audio"]
    assert session["output_modalities"] == ["audio"]
    assert audio["input"]["format"] == {"type": "audio/pcmu", "rate": 8000}
    assert audio["output"]["format"] == {"type": "audio/pcma", "rate": 8000}
    assert audio["input"]["turn_detection"] is None and audio["output"]["voice"] == "verse"


async def test_an_open_microphone_between_turns_never_fills_the_buffer(voice_server):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")  # server VAD is the default
        second = base64.b64encode(np.zeros(24000, "<i2").tobytes()).decode()
        for _ in range(25):  # silence past --max-audio-buffer-seconds 20
            await send(ws, {"type": "input_audio_buffer.append", "audio": second})
        await send(ws, {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})
        events = await events_until(ws, "conversation.item.added")
        assert "error" not in [e["type"] for e in events], events


async def test_the_sdk_sends_audio_and_iterates_the_spoken_answer(voice_server):
    from frontend.client import RealtimeClient

    question = encode_audio(padded(said_naturally(QUESTION, 24000), 24000), "audio/pcm")
    async with RealtimeClient(voice_server.ws_url) as client:
        await client.update_session(output_modalities=["audio"], max_output_tokens=30, temperature=0)
        await client.append_audio(question)  # faster than real time: fine, VAD hears the stream
        response = await asyncio.wait_for(client.next_response(), 60)
        chunks = [chunk async for chunk in response.audio_chunks()]
        await response.wait()
        heard = client.transcripts.get_nowait()
    assert words(heard) == words(QUESTION)
    assert "paris" in response.text.lower() and response.status in ("completed", "incomplete")
    assert len(chunks) >= 1 and b"".join(chunks) == bytes(response.audio) and len(response.audio) > 24000


async def test_audio_sent_much_faster_than_real_time_is_refused(voice_server):
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")  # server VAD: the buffer never fills with silence
        second = base64.b64encode(np.zeros(24000, "<i2").tobytes()).decode()
        for _ in range(40):  # a 30 s burst, then at most 4 s of audio per second
            await send(ws, {"type": "input_audio_buffer.append", "audio": second})
        error = (await events_until(ws, "error"))[-1]["error"]
        assert error["code"] == "rate_limit_exceeded" and error["param"] == "audio"


async def test_an_input_audio_item_is_heard_and_answered(voice_server):
    audio = base64.b64encode(encode_audio(padded(said_naturally(QUESTION, 24000), 24000), "audio/pcm")).decode()
    async with websockets.connect(voice_server.ws_url, max_size=None) as ws:
        await events_until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {"max_output_tokens": 20, "temperature": 0}})
        await events_until(ws, "session.updated")
        await send(ws, {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}})
        added = (await events_until(ws, "conversation.item.added"))[-1]["item"]
        assert words(added["content"][0]["transcript"]) == words(QUESTION) and "audio" not in added["content"][0]
        await send(ws, {"type": "response.create"})
        events = await events_until(ws, "response.done")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert "paris" in answer.lower()
    assert events[-1]["response"]["usage"]["input_token_details"]["audio_tokens"] >= 20  # 2.9 s of audio
