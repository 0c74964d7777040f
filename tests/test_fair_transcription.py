"""The recognizer shares its time fairly between clients: one client's flood of long uploads
does not hold up another client's short voice turn (workers/speech/fair_queue.py)."""

from __future__ import annotations

import threading

import numpy as np
import zmq

from engine import protocol
from workers.speech.fair_queue import FairQueue


def test_a_new_client_waits_for_the_clip_in_service_not_for_the_backlog():
    queue = FairQueue()
    for index in range(10):
        queue.put("flood", 30.0, f"flood-{index}")
    assert queue.get() == "flood-0"  # in service when the honest clip arrives
    queue.put("honest", 2.0, "honest-0")
    assert queue.get() == "honest-0"
    assert [queue.get() for _ in range(9)] == [f"flood-{index}" for index in range(1, 10)]


def test_backlogged_clients_share_the_recognizer_by_audio_seconds():
    queue = FairQueue()
    for index in range(6):
        queue.put("long", 30.0, ("long", 30.0))
    for index in range(18):
        queue.put("short", 10.0, ("short", 10.0))
    served = {"long": 0.0, "short": 0.0}
    for _ in range(12):
        owner, seconds = queue.get()
        served[owner] += seconds
        # Never more than one clip apart while both have clips waiting.
        assert abs(served["long"] - served["short"]) <= 30.0, served
    assert served == {"long": 90.0, "short": 90.0}


def test_within_one_client_clips_keep_their_order():
    queue = FairQueue()
    for index in range(5):
        queue.put("one", float(5 - index), index)
    assert [queue.get() for _ in range(5)] == [0, 1, 2, 3, 4]


def test_a_new_client_waits_for_one_turn_of_each_waiting_client_not_for_their_backlogs():
    queue = FairQueue(quantum=30.0)
    for owner in ("flood-a", "flood-b", "flood-c"):
        for index in range(5):
            queue.put(owner, 30.0, f"{owner}-{index}")
    served = [queue.get() for _ in range(4)]  # a few rounds in
    queue.put("honest", 8.0, "honest-0")
    ahead = []
    while (job := queue.get()) != "honest-0":
        ahead.append(job)
    # At most one clip of each of the three floods goes first.
    assert len(ahead) <= 3 and len({job.rsplit("-", 1)[0] for job in ahead}) == len(ahead), (served, ahead)


def test_owners_with_nothing_waiting_are_forgotten():
    queue = FairQueue()
    for index in range(1000):
        queue.put(f"client-{index}", 1.0, index)
        queue.get()
    assert queue.owners() == 0 and len(queue) == 0


def test_a_clip_longer_than_a_quantum_is_served_once_its_turns_add_up_to_it():
    queue = FairQueue(quantum=8.0)
    queue.put("long", 30.0, "long")
    for index in range(5):
        queue.put("short", 8.0, f"short-{index}")
    # Four turns of 8 s pay for the 30 s clip; the short client has one clip a turn meanwhile.
    assert [queue.get() for _ in range(6)] == ["short-0", "short-1", "short-2", "long", "short-3", "short-4"]


def test_a_short_clip_costs_the_window_the_recognizer_runs():
    from workers.speech.recognizer import window_seconds

    # Whisper's encoder runs over at least eight seconds, so a flood of one-second clips
    # costs what it takes, not one second each.
    assert window_seconds(1.0, 30) == 8
    assert window_seconds(12.2, 30) == 14
    assert window_seconds(30.0, 30) == 30
    assert window_seconds(45.0, 30) == 30


def test_clips_that_do_not_divide_the_quantum_still_get_equal_shares():
    """16 s clips against 30 s ones: a turn's leftover credit carries to the next turn, so
    both clients get the same seconds over time (dropped leftovers gave the 16 s client
    half of the flood's share)."""
    queue = FairQueue(quantum=30.0)
    for _ in range(40):
        queue.put("flood", 30.0, ("flood", 30.0))
    for _ in range(75):
        queue.put("voice", 16.0, ("voice", 16.0))
    served = {"flood": 0.0, "voice": 0.0}
    for _ in range(100):
        owner, seconds = queue.get()
        served[owner] += seconds
        assert abs(served["flood"] - served["voice"]) < 2 * 30.0, served
    assert abs(served["flood"] - served["voice"]) <= 30.0, served


def test_a_client_that_sends_again_while_its_clip_is_served_continues_its_turn():
    """A client whose last waiting clip is in service sends the next one: it goes on with
    what is left of its turn instead of waiting a whole round (it did not wait), and a clip
    that does not fit in that leftover waits behind the others."""
    queue = FairQueue(quantum=30.0)
    queue.put("voice", 8.0, "voice-0")
    queue.put("flood", 30.0, "flood-0")
    queue.put("flood", 30.0, "flood-1")
    assert queue.get() == "voice-0"  # its turn: 30 s of credit, 8 spent
    queue.put("voice", 8.0, "voice-1")  # sent while voice-0 is recognized
    assert queue.get() == "voice-1"  # 14 s of its turn are left
    queue.put("voice", 20.0, "voice-2")  # does not fit in those 14 s
    assert [queue.get() for _ in range(3)] == ["flood-0", "voice-2", "flood-1"]


def test_a_stale_clip_costs_its_owner_nothing():
    """A clip that waited past the encoder's deadline is answered busy without being
    recognized: its owner's turn is not spent on it."""
    stale = {"flood-0", "flood-1", "flood-2"}
    queue = FairQueue(quantum=30.0, stale=lambda job: job in stale)
    for index in range(4):
        queue.put("flood", 30.0, f"flood-{index}")
    queue.put("voice", 8.0, "voice-0")
    # The three stale clips go first (they are answered at once), then the flood's live clip
    # still has its first turn: stale clips spent none of it.
    assert [queue.get() for _ in range(5)] == ["flood-0", "flood-1", "flood-2", "flood-3", "voice-0"]


def test_stop_wakes_a_waiting_recognizer():
    queue = FairQueue()
    got = []
    waiter = threading.Thread(target=lambda: got.append(queue.get()))
    waiter.start()
    queue.stop()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and got == [None]


def test_the_recognizer_thread_answers_a_short_clip_before_a_flood_of_long_ones():
    """Whisper itself: a flood's 20 s clips queued first, another client's 1 s clip after."""
    from workers.speech.recognizer import SpeechRecognizer
    from workers.speech.transcription_thread import TranscriptionThread

    recognizer = SpeechRecognizer(None)
    context = zmq.Context()
    outputs = context.socket(zmq.PULL)
    port = outputs.bind_to_random_port("tcp://127.0.0.1")
    # A recognizer thread that has not started on the flood yet: the first clip goes in
    # service only when every clip has been submitted (as when they arrive in one burst).
    gate = threading.Event()
    original = recognizer.transcribe

    def transcribe(samples):
        gate.wait(timeout=30)
        return original(samples)

    recognizer.transcribe = transcribe
    thread = TranscriptionThread(recognizer, context, f"tcp://127.0.0.1:{port}", max_wait_s=600)
    rng = np.random.default_rng(0)
    try:
        for index in range(4):
            thread.submit(f"flood-{index}", (0.01 * rng.standard_normal(20 * 16_000)).astype(np.float32),
                          "tenant-b/127.0.0.200")
        thread.submit("honest", (0.01 * rng.standard_normal(16_000)).astype(np.float32), "tenant-a/127.0.0.10")
        gate.set()
        answered = []
        for _ in range(2):
            assert outputs.poll(120_000), answered
            answer = protocol.decode_output(outputs.recv())
            assert answer.error is None, answer
            answered.append(answer.request_id)
        # flood-0 was taken (the thread was waiting at the gate with it); the short clip is next.
        assert answered == ["flood-0", "honest"]
    finally:
        gate.set()
        thread.stop()
        thread.thread.join(timeout=120)  # the clip in service ends; its socket closes
        outputs.close(linger=0)
        context.term()


def test_a_clip_that_waited_past_its_deadline_is_refused_as_busy_not_as_a_failure():
    """A flood's clip that waited longer than the encoder's deadline behind other clients'
    clips: the client is told to retry (429 voice_busy), not that the engine failed (503)."""
    import asyncio

    import pytest

    from frontend.engine_errors import VoiceBusy
    from frontend.speech_recognition import recognized_segments
    from workers.speech.recognizer import SpeechRecognizer
    from workers.speech.transcription_thread import TranscriptionThread

    context = zmq.Context()
    outputs = context.socket(zmq.PULL)
    port = outputs.bind_to_random_port("tcp://127.0.0.1")
    thread = TranscriptionThread(SpeechRecognizer(None), context, f"tcp://127.0.0.1:{port}", max_wait_s=-1.0)
    try:
        thread.submit("late", np.zeros(16_000, dtype=np.float32), "tenant-b/127.0.0.200")
        assert outputs.poll(60_000)
        answer = protocol.decode_output(outputs.recv())
    finally:
        thread.stop()
        outputs.close(linger=0)
        context.term()
    assert answer.busy and "busy" in answer.error

    class Encoder:
        async def transcribe(self, samples, requester):
            return answer

    async def recognize():
        return [segment async for segment in recognized_segments(Encoder(), np.zeros(16_000, np.float32))]

    with pytest.raises(VoiceBusy):
        asyncio.run(recognize())


def test_the_front_end_waits_for_a_transcript_longer_than_the_encoder_lets_a_clip_wait():
    """An operator's --encoder-timeout of five minutes: a clip may wait that long for the
    recognizer and is then recognized, so the front end must not give up on it first (it
    would answer 503 for a clip the encoder is about to answer)."""
    from engine.config import EngineConfig
    from frontend.engine_client import EngineClient

    for encoder_timeout_s in (10.0, 60.0, 300.0):
        engine = EngineClient(EngineConfig(model="unused", encoder_timeout_s=encoder_timeout_s))
        assert engine.transcribe_timeout_s > encoder_timeout_s + 30.0
