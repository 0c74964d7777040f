"""Speech recognition beside the encoder process's loop, on a thread of its own.

A 30-second clip takes a second or more of Whisper on a CPU (tens of seconds on a loaded
one); run inline, it would hold up every image embedding the decoder waits for and the
heartbeats that tell the frontend the encoder lives. Torch releases the GIL while it
computes, so a thread is enough. The thread has its own ZeroMQ socket to the frontend
(sockets are not shared across threads). Clips wait in a fair queue (fair_queue.py): one
client's backlog does not hold up the others'. A clip that waited longer than `max_wait_s` is
answered with an error instead of being recognized for a client that has given up.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import zmq

from engine import link_keys, protocol
from engine.audio_windows import RECOGNIZER_RATE
from workers.speech.fair_queue import FairQueue

logger = logging.getLogger("antiphon.encoder")


class TranscriptionThread:
    def __init__(self, recognizer, context: zmq.Context, output_address: str, max_wait_s: float) -> None:
        self.recognizer = recognizer
        self.context = context
        self.output_address = output_address
        self.max_wait_s = max_wait_s
        self.jobs = FairQueue(quantum=recognizer.max_seconds, stale=self._waited_too_long)
        self.thread = threading.Thread(target=self._run, name="speech-recognition", daemon=True)
        self.thread.start()

    def submit(self, request_id: str, samples: np.ndarray, owner: str = "") -> None:
        """`owner`: who the clip is for (the front end's tenant and client); clips of different
        owners share the recognizer's time equally."""
        cost = self.recognizer.window_seconds(len(samples) / RECOGNIZER_RATE)
        self.jobs.put(owner, cost, (request_id, samples, time.monotonic()))

    def _waited_too_long(self, job) -> bool:
        _, _, arrived = job
        return time.monotonic() - arrived > self.max_wait_s

    def stop(self) -> None:
        self.jobs.stop()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        socket = self.context.socket(zmq.PUSH)
        try:
            link_keys.connect(socket, self.output_address)
            while (job := self.jobs.get()) is not None:
                socket.send(protocol.encode(self._transcribe(*job)))
        finally:
            socket.close(linger=0)

    def _transcribe(self, request_id: str, samples: np.ndarray, arrived: float) -> protocol.AudioTranscript:
        waited = time.monotonic() - arrived
        if waited > self.max_wait_s:
            return protocol.AudioTranscript(request_id=request_id, busy=True,
                                            error=f"the recognizer was busy for {waited:.0f} s; try again")
        started = time.perf_counter()
        try:
            transcript = self.recognizer.transcribe(samples)
        except Exception as exc:  # one bad clip fails itself, never the encoder
            logger.exception("speech recognition failed for %s", request_id)
            return protocol.AudioTranscript(request_id=request_id, error=f"speech recognition failed: {exc}")
        return protocol.AudioTranscript(
            request_id=request_id, text=transcript.text, no_speech_probability=transcript.no_speech_probability,
            audio_seconds=transcript.audio_seconds, seconds=time.perf_counter() - started)
