"""The front end's side of the talker, which speaks answers when voice is on.

`open_speech` gives an answer its audio queue, `speak` feeds it text, `cancel_speech` stops it;
the audio comes back on a socket of its own, read by `read_speech` (a background task). With an
omni model the model speaks its own answers: the decoder hands the talker the thinker's rows
(the engine request carries SpeechOptions, see `speech_options`) and `speak` sends nothing. At most
as many answers are spoken at once as the `spoken_answers` share allows. Losing the talker
fails the answers being spoken, not text: /health stays healthy while it restarts (the
supervisor's `voice_status` says why voice is down).
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq

from engine import protocol
from frontend.engine_errors import EngineUnavailable, voice_slot
from frontend.tenancy import ANONYMOUS, FairShare, Requester, ShareSlot

logger = logging.getLogger("antiphon.frontend")


class TalkerClient:
    def __init__(self, workers, spoken_answers: FairShare) -> None:
        self.workers = workers  # the WorkerSupervisor
        self.spoken_answers = spoken_answers
        # Answers being spoken: their audio.
        self.speech_queues: dict[str, asyncio.Queue] = {}
        self._speech_slots: dict[str, ShareSlot] = {}

    @property
    def speaks_itself(self) -> bool:
        """Whether the model speaks its own answers (an omni model's talker), not the text it is sent."""
        return self.workers.config.omni_speech

    @property
    def voices(self) -> list[str]:
        """The omni talker's speakers (empty until it is ready, and with the cascade)."""
        ready = self.workers.ready.get("talker")
        return list(ready.voices) if ready is not None else []

    def speaker(self, voice: str) -> str:
        """The omni model's speaker that `voice` names (case aside); ValueError if none does
        (ask once the talker is ready: until then it has no voices)."""
        voices = self.voices
        for name in voices:
            if name.lower() == voice.lower():
                return name
        raise ValueError(f"unknown voice {voice!r}: this model speaks as {', '.join(voices)}")

    def speech_options(self, request_id: str, voice: str, sample_rate: int,
                       seed: int | None = None) -> protocol.SpeechOptions | None:
        """What the engine request of a spoken answer carries (None with the cascade); `seed`
        (the request's) makes its audio reproducible."""
        if not self.speaks_itself:
            return None
        return protocol.SpeechOptions(speech_id=request_id, voice=self.speaker(voice), sample_rate=sample_rate,
                                      seed=seed)

    @property
    def voice_ready(self) -> bool:
        return self.workers.config.voice and "talker" in self.workers.running and not self.workers.failed

    def open_speech(self, request_id: str, requester: Requester = ANONYMOUS, *, queue: asyncio.Queue | None = None,
                    slot: ShareSlot | None = None) -> asyncio.Queue:
        """A queue that receives the answer's SpeechAudio messages as (header, pcm bytes),
        the last with `final` set. Call `speak` to feed it text; `cancel_speech` to stop.
        `queue` and `slot`: opened earlier by a replica set (frontend/replica_set.py), bound
        here once the answer's replica is known."""
        if not self.voice_ready:
            raise EngineUnavailable(f"voice unavailable: {self.workers.voice_status}")
        if request_id in self.speech_queues:
            raise ValueError(f"speech {request_id!r} is already in flight")
        self._speech_slots[request_id] = slot if slot is not None else voice_slot(self.spoken_answers, requester)
        queue = queue if queue is not None else asyncio.Queue()
        self.speech_queues[request_id] = queue
        return queue

    def _end_speech(self, request_id: str) -> asyncio.Queue | None:
        """Forget an answer's audio queue and free its share of the talker; None if it had ended."""
        slot = self._speech_slots.pop(request_id, None)
        if slot is not None:
            slot.release()
        return self.speech_queues.pop(request_id, None)

    async def speak(self, request_id: str, text: str, *, sample_rate: int, final: bool = False,
                    speed: float = 1.0) -> None:
        if request_id not in self.speech_queues or self.speaks_itself:
            # Cancelled or failed meanwhile: nothing listens any more. Or the model speaks its
            # own answer, from the rows the decoder hands the talker.
            return
        # Never blocks: a talker that stopped reading must not hold up the answer's text.
        await self.workers.send("talker", protocol.encode(protocol.SpeakText(
            request_id=request_id, text=text, final=final, sample_rate=sample_rate, speed=speed)), block=False)

    def cancel_speech(self, request_id: str) -> None:
        """Stop speaking an answer (barge-in, a client gone); idempotent and synchronous."""
        if self._end_speech(request_id) is None or "talker" not in self.workers.running:
            return
        self.workers.send_in_background("talker", protocol.encode(protocol.CancelSpeech([request_id])))

    async def read_speech(self) -> None:
        while True:
            try:
                frames = await self.workers.from_talker.recv_multipart(copy=False)
            except zmq.Again:
                continue  # woken with nothing to read (seen on CurveZMQ tcp links): not a failure
            try:
                message = protocol.decode_speech(frames[0].bytes)
            except msgspec.DecodeError as exc:
                logger.error("skipped a talker message that does not decode: %s", exc)
                continue
            self.workers.heard_from("talker")
            queue = self.speech_queues.get(message.request_id)
            if queue is None:
                continue  # cancelled: the talker has been told
            queue.put_nowait((message, frames[1].bytes if len(frames) > 1 else b""))
            if message.final:
                self._end_speech(message.request_id)

    def fail_speech(self, reason: str) -> None:
        for request_id in list(self.speech_queues):
            self._end_speech(request_id).put_nowait((protocol.SpeechAudio(
                request_id=request_id, sample_rate=0, final=True, error=reason), b""))
