"""The decoder's side of an omni model's spoken answers: the thinker's rows, sent to the talker.

For every request that carries SpeechOptions, the decoder tells the talker process about the
answer when it is added (StartSpeaking) and, after each step, sends the rows of the positions
it forwarded (ThinkerRows: a msgpack header and the rows as one raw frame, never pickled),
ending with a message that says how the text ended. Rows are read from the hidden-state store
(engine/thinker_rows.py), so a prefix hit's rows cost no recomputation.

Never blocks the decoder, and never drops a message for a talker that is alive: the socket
queues without a bound for a connected talker (a talker that falls behind holds at most the
rows of the answers being spoken, which the hidden-state store holds already), and queues
nothing for a talker that is not connected (ZMQ_IMMEDIATE): then sends fail at once, the
answer's speech ends here, and the frontend fails it as it fails every answer of a lost talker
(the supervisor restarts it). The thinker's text goes on either way.
"""

from __future__ import annotations

import logging

import numpy as np
import zmq

from engine import protocol
from engine.array_frames import tensor_bytes
from engine.thinker_rows import RowsChunk, TalkerPrompt, ThinkerRowsFeed

logger = logging.getLogger("antiphon.decoder")


class ThinkerRowsSender:
    def __init__(self, context: zmq.Context, address: str, runner, adapter) -> None:
        self.socket = context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # no bound: see above
        self.socket.connect(address)
        self.feed = ThinkerRowsFeed(runner)
        self.adapter = adapter
        # Thinker request id -> the talker's id of its answer.
        self.speech_ids: dict[str, str] = {}

    def talker_prompt(self, message: protocol.EngineRequest) -> TalkerPrompt:
        """How the answer's talker prompt is made of its prompt; ValueError if it cannot be."""
        try:
            prompt = self.adapter.talker_prompt(message.prompt_token_ids, message.mm_placeholders)
            prompt.validate()
        except Exception as exc:  # noqa: BLE001 - one answer refused, never the decoder down
            raise ValueError(f"the answer cannot be spoken: {exc}") from exc
        return prompt

    def add(self, request_id: str, message: protocol.EngineRequest, prompt: TalkerPrompt) -> None:
        """Announce a spoken answer whose request the engine has just taken (`prompt` as
        `talker_prompt` made it)."""
        positions = prompt.mrope_positions
        header = protocol.StartSpeaking(speech=message.speech, cut=prompt.cut, kept=prompt.kept, items=prompt.items,
                                        has_positions=positions is not None, mrope_delta=prompt.mrope_delta)
        frames = [] if positions is None else [memoryview(np.ascontiguousarray(positions, dtype=np.int64)).cast("B")]
        self.speech_ids[request_id] = message.speech.speech_id
        self.feed.add(request_id, len(message.prompt_token_ids), prompt)
        if not self._send(header, frames):
            self._forget(request_id)

    def after_step(self, outputs) -> None:
        try:
            chunks = self.feed.after_step(outputs)
        except Exception:  # noqa: BLE001 - speech must never take the decoder (and text) down
            logger.exception("reading the thinker's rows failed: this step's spoken answers are not spoken")
            chunks = [RowsChunk(out.request_id, 0, None, ended=True, error="the thinker's rows could not be read")
                      for out in outputs if out.request_id in self.feed]
            for chunk in chunks:
                self.feed.drop(chunk.request_id)
        for chunk in chunks:
            self._send_chunk(chunk)

    def aborted(self, request_ids: list[str]) -> None:
        """The frontend ended these requests (a stop string, a client gone): what was handed
        over is spoken, a step or two past a stop string (the frontend cancels the speech
        itself when nobody listens)."""
        for request_id in request_ids:
            chunk = self.feed.end(request_id)
            if chunk is not None:
                self._send_chunk(chunk)

    def _send_chunk(self, chunk: RowsChunk) -> None:
        speech_id = self.speech_ids.get(chunk.request_id)
        if speech_id is None:
            return
        header = protocol.ThinkerRows(speech_id=speech_id, start=chunk.start, ended=chunk.ended, error=chunk.error)
        frames = []
        if chunk.rows is not None:
            header.dtype, header.shape, frame = tensor_bytes(chunk.rows)
            frames.append(frame)
        if not self._send(header, frames) or chunk.ended:
            self._forget(chunk.request_id)

    def _send(self, header, frames: list) -> bool:
        try:
            self.socket.send_multipart([protocol.encode(header), *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            logger.warning("no talker is connected: %s is not spoken",
                           getattr(header, "speech_id", None) or header.speech.speech_id)
            return False

    def _forget(self, request_id: str) -> None:
        self.feed.drop(request_id)
        self.speech_ids.pop(request_id, None)

    def close(self) -> None:
        self.socket.close(linger=0)
