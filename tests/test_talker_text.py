"""The talker process's loop (workers/talker_process.py) with the real Piper voice, over real
ZeroMQ sockets, on what a model may say: text with nothing to speak ends its answer with
empty audio and no error, and text that crashed espeak-ng is spoken."""

from __future__ import annotations

import argparse
import itertools
import threading

import numpy as np
import pytest
import zmq

from engine import protocol
from engine.config import EngineConfig
from workers.talker_process import TalkerWorker

# The talker drops text for an answer id it has closed: every answer here gets a new one.
ANSWER_IDS = (f"answer-{n}" for n in itertools.count())


@pytest.fixture(scope="module")
def talker(talker_parts):
    _, inputs, _, speech = talker_parts
    return inputs, speech


@pytest.fixture(scope="module")
def talker_parts():
    """A loaded TalkerWorker running in a thread, and the frontend's ends of its sockets."""
    context = zmq.Context()
    inputs, outputs, speech = context.socket(zmq.PUSH), context.socket(zmq.PULL), context.socket(zmq.PULL)
    addresses = argparse.Namespace(**{name: f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
                                      for name, socket in (("input", inputs), ("output", outputs),
                                                           ("speech", speech))})
    worker = TalkerWorker(EngineConfig(model="unused", voice=True), addresses)
    worker.load()
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    yield worker, inputs, outputs, speech
    inputs.send(protocol.encode(protocol.Shutdown()))
    thread.join(timeout=30)
    worker.close()
    for socket in (inputs, outputs, speech):
        socket.close(linger=0)
    context.term()


def spoken_answer(talker, request_id: str, deltas: list[str]) -> tuple[list[protocol.SpeechAudio], bytes]:
    """Sends an answer's text as streamed deltas; its SpeechAudio headers and all its PCM."""
    inputs, speech = talker
    for index, delta in enumerate(deltas):
        inputs.send(protocol.encode(protocol.SpeakText(request_id=request_id, text=delta,
                                                       final=index == len(deltas) - 1)))
    headers, pcm = [], b""
    while not (headers and headers[-1].final):
        assert speech.poll(120_000), "the talker sent nothing for two minutes"
        frames = speech.recv_multipart()
        headers.append(protocol.decode_speech(frames[0]))
        assert headers[-1].request_id == request_id
        pcm += b"".join(frames[1:])
    return headers, pcm


@pytest.mark.parametrize("deltas", [["😀", "🎉"], ["...", "!?"], ["  ", "\n"], ["**", " — ", "*"]])
def test_an_answer_with_nothing_to_speak_ends_with_empty_audio_and_no_error(talker, deltas):
    headers, pcm = spoken_answer(talker, next(ANSWER_IDS), deltas)
    assert headers[-1].final and all(header.error is None for header in headers)
    assert pcm == b""


def test_an_answer_that_crashed_espeak_is_spoken_to_the_end(talker):
    deltas = ["Sure, here it is: ", "a." * 60, "a." * 60, " and www.", "x." * 90, "com. ", "That is all."]
    headers, pcm = spoken_answer(talker, next(ANSWER_IDS), deltas)
    assert all(header.error is None for header in headers)
    samples = np.frombuffer(pcm, dtype="<i2")
    assert len(samples) / 24000 > 5.0 and np.abs(samples).max() > 3000


def test_a_voice_that_says_nothing_fails_the_talker_at_load(monkeypatch):
    from workers.speech import piper_voice

    monkeypatch.setattr(piper_voice.PiperVoice, "synthesize", lambda self, text, speed=1.0: np.zeros(0, np.float32))
    context = zmq.Context()
    sockets = [context.socket(zmq.PULL) for _ in range(3)]
    ports = [socket.bind_to_random_port("tcp://127.0.0.1") for socket in sockets]
    addresses = argparse.Namespace(**{name: f"tcp://127.0.0.1:{port}" for name, port in
                                      zip(("input", "output", "speech"), ports)})
    worker = TalkerWorker(EngineConfig(model="unused", voice=True), addresses)
    try:
        with pytest.raises(RuntimeError, match="espeak-ng"):
            worker.load()
    finally:
        worker.close()
        for socket in sockets:
            socket.close(linger=0)
        context.term()


def test_a_long_clause_is_spoken_while_the_talker_keeps_beating(talker_parts):
    """A clause that takes seconds to make (a busy CPU) is work, not a hang: the talker still
    sends its heartbeat every second, so the frontend's watchdog does not kill it."""
    import time

    worker, inputs, outputs, speech = talker_parts
    real = worker.voice.synthesize

    def slow(text, speed=1.0):
        time.sleep(3.5)
        return real(text, speed=speed)

    worker.voice.synthesize = slow
    try:
        while outputs.poll(0):
            outputs.recv()
        request_id = next(ANSWER_IDS)
        inputs.send(protocol.encode(protocol.SpeakText(request_id=request_id, text="Hello there.", final=True)))
        beats = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not speech.poll(0):
            if outputs.poll(200):
                message = protocol.decode_output(outputs.recv())
                if isinstance(message, protocol.Heartbeat):
                    beats.append(time.monotonic())
        assert speech.poll(0), "the clause was never spoken"
        gaps = [b - a for a, b in zip(beats, beats[1:])]
        assert len(beats) >= 3 and max(gaps) < 2.0, beats
        while not protocol.decode_speech(speech.recv_multipart()[0]).final:
            pass
    finally:
        worker.voice.synthesize = real
