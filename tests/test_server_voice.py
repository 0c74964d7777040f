"""The served voice endpoints with the real speech models: /v1/audio/transcriptions (Whisper
in the encoder process) and /v1/audio/speech (Piper in the talker process), through the
official `openai` package and raw HTTP, bad input, and a talker that dies."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
import uuid

import numpy as np
import openai
import pytest

from engine.audio_formats import read_wav, write_wav
from tests.server_harness import get_json, request
from tests.spoken import spoken, transcript_similarity, words


@pytest.fixture(scope="module")
def server(voice_server):
    return voice_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def multipart(fields: dict[str, str], file: bytes, filename: str = "question.wav") -> tuple[bytes, dict]:
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
                 f"Content-Type: audio/wav\r\n\r\n".encode() + file + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def question_wav(text: str = "What is the capital of France?") -> bytes:
    return write_wav(spoken(text, rate=22050), 22050)


def test_a_spoken_question_is_transcribed_through_the_openai_package(client):
    transcript = client.audio.transcriptions.create(model="whisper-1", file=("q.wav", question_wav()))
    assert words(transcript.text) == words("What is the capital of France?")
    text = client.audio.transcriptions.create(model="whisper-1", file=("q.wav", question_wav()), response_format="text")
    assert words(text) == words("What is the capital of France?")
    verbose = client.audio.transcriptions.create(model="whisper-1", file=("q.wav", question_wav()),
                                                 response_format="verbose_json")
    assert verbose.language == "english" and 1.0 < verbose.duration < 4.0 and len(verbose.segments) == 1


def test_a_streamed_transcript_ends_with_the_whole_text(server):
    body, headers = multipart({"model": "whisper-1", "stream": "true"}, question_wav())
    status, text = request("POST", server.url + "/v1/audio/transcriptions", body, headers)
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["transcript.text.delta", "transcript.text.done"]
    assert events[0]["delta"] == events[1]["text"]
    assert words(events[1]["text"]) == words("What is the capital of France?")


def test_silence_transcribes_to_nothing(client):
    silence = write_wav(np.zeros(32000, dtype=np.float32), 16000)
    assert client.audio.transcriptions.create(model="whisper-1", file=("s.wav", silence)).text == ""


def test_speech_round_trips_through_the_recognizer(client):
    sentence = "The capital of France is Paris. It is a beautiful city."
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=sentence,
                                                            response_format="wav") as response:
        audio = response.read()
    samples, rate = read_wav(audio_with_length(audio))
    assert rate == 24000 and len(samples) / rate > 2.0
    transcript = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", write_wav(samples, rate)))
    assert transcript_similarity(transcript.text, sentence) > 0.8, transcript.text


def audio_with_length(streamed_wav: bytes) -> bytes:
    """A streamed WAV announces an open length; fix its sizes so any reader takes it."""
    data = bytearray(streamed_wav)
    data[4:8] = (len(data) - 8).to_bytes(4, "little")
    data[40:44] = (len(data) - 44).to_bytes(4, "little")
    return bytes(data)


def post_speech(server, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(server.url + "/v1/audio/speech", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as response:
        return response.status, response.read()


def test_speech_streams_pcm_in_several_pieces_as_it_is_made(server):
    sentence = "First, a short clause. Then a whole sentence follows it. And one more to end."
    started = time.perf_counter()
    req = urllib.request.Request(server.url + "/v1/audio/speech", method="POST",
                                 data=json.dumps({"model": "tts-1", "voice": "alloy", "input": sentence,
                                                  "response_format": "pcm"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("audio/pcm")
        first = response.read1(65536)
        first_at = time.perf_counter() - started
        rest = response.read()
    total = time.perf_counter() - started
    pcm = np.frombuffer(first + rest, dtype="<i2")
    assert len(pcm) / 24000 > 3.0
    # The first clause arrives before the whole answer is synthesized.
    assert first_at < total * 0.7


@pytest.mark.parametrize("body, param, code", [
    ({"model": "tts-1", "voice": "alloy", "input": ""}, "input", "invalid_value"),
    ({"model": "tts-1", "voice": "alloy", "input": "x" * 501}, "input", "string_above_max_length"),
    ({"model": "tts-1", "voice": "alloy", "input": "Hi.", "response_format": "mp3"}, "response_format",
     "invalid_value"),
    ({"model": "tts-1", "voice": "alloy", "input": "Hi.", "speed": 9}, "speed", "invalid_value"),
    ({"model": "tts-1", "voice": "alloy", "input": "Hi.", "instructions": "whisper"}, "instructions",
     "unsupported_parameter"),
    ({"model": "tts-1", "voice": "alloy", "input": "Hi.", "pitch": 2}, "pitch", "unsupported_parameter"),
])
def test_bad_speech_requests_get_a_400_naming_the_field(server, body, param, code):
    status, text = request("POST", server.url + "/v1/audio/speech", body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert (error["param"], error["code"]) == (param, code)


@pytest.mark.parametrize("text", ["😀🎉", "...!?", "   \n\t", "— * —", "\u200f\u200b"])
def test_speech_of_text_with_nothing_to_say_is_refused(server, text):
    status, body = request("POST", server.url + "/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": text})
    assert status == 400, body
    error = json.loads(body)["error"]
    assert (error["param"], error["code"]) == ("input", "nothing_to_speak")


@pytest.mark.parametrize("text", ["a." * 100, "Visit www." + "x." * 90 + "com today.", "e.g. " + "b" * 170])
def test_speech_of_text_that_crashed_espeak_is_audio(server, text):
    status, audio = post_speech(server, {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"})
    assert status == 200 and len(audio) > 2 * 24000  # over a second of 16-bit audio


@pytest.mark.parametrize("fields, file, param, code, status", [
    ({"model": "whisper-1"}, b"ID3 not a wav at all", "file", "invalid_audio", 400),
    ({"model": "whisper-1", "response_format": "srt"}, None, "response_format", "invalid_value", 400),
    ({"model": "whisper-1", "language": "fr"}, None, "language", "invalid_value", 400),
    ({"model": "whisper-1", "timestamp_granularities[]": "word"}, None, "timestamp_granularities[]",
     "unsupported_parameter", 400),
    ({"model": "whisper-1"}, "too long", "file", "audio_too_long", 400),
])
def test_bad_transcription_requests_are_refused_clearly(server, fields, file, param, code, status):
    if file is None:
        file = question_wav()
    elif file == "too long":
        file = write_wav(np.zeros(61 * 16000, dtype=np.float32), 16000)
    body, headers = multipart(fields, file)
    got, text = request("POST", server.url + "/v1/audio/transcriptions", body, headers)
    assert got == status, text
    error = json.loads(text)["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_a_killed_talker_fails_speech_not_text_and_comes_back(server, client):
    [talker] = server.worker_pids("talker")
    os.kill(talker, signal.SIGKILL)
    # Text keeps working while the talker is down or restarting.
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert get_json(server.url + "/health")[0] == 200
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = server.worker_pids("talker")
        if pids and pids != [talker] and get_json(server.url + "/health")[1].get("voice") == "ready":
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the talker did not come back:\n{server.log_text()}")
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="Back again.",
                                                            response_format="pcm") as response:
        assert len(response.read()) > 24000  # more than half a second of 16-bit audio
    assert server.metric("antiphon_talker_restarts_total") >= 1


def test_a_client_that_leaves_mid_speech_stops_its_synthesis(server):
    import http.client

    long_text = " ".join(f"This is sentence number {i} of a long answer." for i in range(8))
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v1/audio/speech", json.dumps({"model": "tts-1", "voice": "alloy",
                                                               "input": long_text}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    response.read(1000)
    connection.close()  # gone after the first piece
    # The server goes on serving speech at once: the abandoned answer is not synthesized to the end.
    started = time.perf_counter()
    status, audio = post_speech(server, {"model": "tts-1", "voice": "alloy", "input": "Quick.",
                                         "response_format": "pcm"})
    assert status == 200 and len(audio) > 4800
    assert time.perf_counter() - started < 3.0


def test_chat_completions_hear_input_audio_and_speak_the_answer(client):
    import base64

    from tests.spoken import said_naturally

    question = base64.b64encode(write_wav(said_naturally("What is the capital of France?", 24000), 24000)).decode()
    answer = client.chat.completions.create(
        model="m", modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}, temperature=0,
        max_tokens=30, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": question, "format": "wav"}}]}])
    audio = answer.choices[0].message.audio
    assert "paris" in audio.transcript.lower()
    samples, rate = read_wav(base64.b64decode(audio.data))
    heard = client.audio.transcriptions.create(model="whisper-1", file=("a.wav", write_wav(samples, rate)))
    assert transcript_similarity(heard.text, audio.transcript) > 0.8, (heard.text, audio.transcript)
    # The next turn sends the spoken answer back by its id, as OpenAI's clients do.
    again = client.chat.completions.create(model="m", temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "audio": {"id": audio.id}},
        {"role": "user", "content": "Say it once more."}])
    assert again.choices[0].message.content


def test_streamed_chat_audio_comes_with_its_transcript(client):
    import base64

    stream = client.chat.completions.create(
        model="m", modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"}, temperature=0,
        max_tokens=30, stream=True, messages=[{"role": "user", "content": "What is the capital of France?"}])
    transcript, pcm = "", b""
    for chunk in stream:
        if chunk.choices and getattr(chunk.choices[0].delta, "audio", None):
            audio = chunk.choices[0].delta.audio
            transcript += getattr(audio, "transcript", None) or ""
            pcm += base64.b64decode(getattr(audio, "data", None) or "")
    assert "paris" in transcript.lower()
    assert len(pcm) / 2 / 24000 > 0.5


def test_streamed_chat_audio_must_be_pcm16(server):
    status, text = request("POST", server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "stream": True, "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"}}, {"Content-Type": "application/json"})
    assert status == 400 and json.loads(text)["error"]["param"] == "audio.format"
