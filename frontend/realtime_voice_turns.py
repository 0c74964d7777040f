"""The user's spoken turns in a Realtime session: input audio in, user items out.

`VoiceTurns` owns the input audio buffer, the turn detector (server VAD, made when first
needed) and the turn being spoken now. Audio appends feed the detector; a turn it ends (or an
input_audio_buffer.commit) becomes a user item whose transcript is its text, recognized off
the socket and joined to the conversation in the order of the conversation's work. Recognition
starts early, as soon as a pause begins that may end the turn, so the transcript is (nearly)
ready when it does. Speech that starts while an answer plays interrupts it (barge-in).

It holds its session to send events, read the session's current settings, take its turn in
the conversation's work and start the response a turn asks for.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from engine.audio_windows import RECOGNIZER_RATE
from frontend.edge_decoding import InvalidInput
from frontend.engine_errors import EngineUnavailable, VoiceBusy
from frontend.limits import EventRate
from frontend.realtime_audio import InputAudioBuffer, decode_client_audio, new_turn_detector
from frontend.realtime_conversation import new_id
from frontend.realtime_events import AudioAppend, AudioCommit, ResponseCreate
from frontend.realtime_work import off_the_socket
from frontend.speech_recognition import transcribe

if TYPE_CHECKING:
    from frontend.realtime import RealtimeSession

logger = logging.getLogger("antiphon.realtime")

# Seconds of audio a session may send at once, past its --max-audio-speedup rate.
AUDIO_BURST_S = 30.0
# Recognition of a turn starts this long before its pause would end it: about what Whisper
# takes for a short question here, so the transcript is ready as the turn ends.
EARLY_LEAD_MS = 250


def require_voice(engine_config, param: str) -> None:
    if not engine_config.voice:
        raise InvalidInput("voice is off on this server (started with --no-voice)", "unsupported_modality", param)


class VoiceTurns:
    def __init__(self, session: RealtimeSession) -> None:
        self.session = session
        self.config = session.config
        self.audio_rate = EventRate(self.config.max_audio_speedup, capacity=AUDIO_BURST_S)
        # The input audio buffer, the turn detector, and the turn the user is speaking now (its
        # item id and start).
        self.audio_buffer = InputAudioBuffer(self.config.max_audio_buffer_seconds)
        self.detector = None
        self.detector_offset_ms = 0.0
        self.speech_item_id: str | None = None
        self.speech_start_ms: int | None = None
        # The turn's recognition started early, when a pause began: ((item id, pause start), task).
        self.early_transcript: tuple[tuple[str, int], asyncio.Task] | None = None
        # Speech starts that interrupt answers (an answer asked for before one is cancelled as
        # it starts, as if it had been playing).
        self.barge_ins = 0

    @property
    def _input_settings(self) -> dict:
        return self.session.session["audio"]["input"]

    @property
    def hears_audio(self) -> bool:
        """Whether the model hears turns itself (an omni model): then they are not transcribed."""
        return self.session.state.generation.hears_audio

    def _check_audio_window(self, seconds: float, param: str | None) -> None:
        """A clip the model hears must fit its window (Qwen2.5-Omni's 30 s): refused when it is
        kept, not at every later response."""
        adapter = self.session.state.generation.adapter
        window = adapter.max_audio_samples / adapter.sample_rate
        if seconds > window:
            raise InvalidInput(f"{seconds:.1f} s of audio is longer than the model hears at once ({window:g} s)",
                               "audio_too_long", param)

    def _require_audio_in(self, param: str) -> None:
        """Audio in needs the recognizer, unless the model hears it itself."""
        if not self.hears_audio:
            require_voice(self.session.state.engine_config, param)

    async def append(self, event: AudioAppend) -> None:
        self._require_audio_in("audio")
        settings = self._input_settings
        samples = decode_client_audio(event.audio, settings["format"]["type"], "audio")
        seconds = len(samples) / settings["format"]["rate"]
        if seconds > AUDIO_BURST_S:
            raise InvalidInput(f"one append carries at most {AUDIO_BURST_S:g} s of audio; send it in chunks",
                               "audio_chunk_too_large", "audio")
        if not self.audio_rate.allow(seconds):
            raise InvalidInput(f"audio sent faster than {self.config.max_audio_speedup:g}x real time "
                               "(--max-audio-speedup); this chunk was dropped", "rate_limit_exceeded", "audio")
        detection = settings["turn_detection"]
        if detection is not None and self.speech_item_id is None:
            # Between turns only the coming turn's prefix padding can be committed.
            self.audio_buffer.keep_last(detection["prefix_padding_ms"] + 1000)
        position_ms = self.audio_buffer.stream_ms
        resampled = self.audio_buffer.append(samples, settings["format"]["rate"])
        if detection is None:
            return
        from workers.speech.voice_activity import SpeechStarted

        if self.detector is None:
            self.detector = new_turn_detector(threshold=detection["threshold"],
                                              prefix_padding_ms=detection["prefix_padding_ms"],
                                              silence_duration_ms=detection["silence_duration_ms"])
            self.detector_offset_ms = position_ms
        detector = self.detector
        # Silero runs a model: a worker thread keeps the event loop free for other sessions,
        # and the socket is read meanwhile (on a loaded machine the threads may all be busy).
        for vad_event in await off_the_socket(asyncio.to_thread(detector.feed, resampled)):
            if detector is not self.detector:
                return  # settings changed or the buffer was cleared meanwhile
            # The detector counts from its own first sample; events name stream times.
            if isinstance(vad_event, SpeechStarted):
                await self._speech_started(int(self.detector_offset_ms + vad_event.audio_start_ms), detection)
            elif self.speech_item_id is not None:
                # OpenAI's audio_end_ms counts the silence that ended the turn.
                end_ms = self.detector_offset_ms + vad_event.audio_end_ms + detection["silence_duration_ms"]
                await self._speech_stopped(int(end_ms), vad_event.audio_end_ms, detection)
        if detector is self.detector:
            self._recognize_early(detector)

    def _recognize_early(self, detector) -> None:
        """Recognizes the turn as soon as a pause begins, while VAD waits to see whether the
        pause ends the turn (silence_duration_ms): when it does, the transcript is (nearly)
        ready. Speech that resumes drops the early result; the encoder's work on it is lost."""
        pause = detector.silence_from_ms
        if pause is None or self.speech_item_id is None or self.hears_audio:
            self.drop_early_transcript()
            return
        # Not at every gap between words: only a pause already close to ending the turn, and
        # one attempt at a time per session (the encoder finishes what it started anyway).
        lead = max(0, self._input_settings["turn_detection"]["silence_duration_ms"] - EARLY_LEAD_MS)
        if detector.position_ms - pause < lead:
            return
        key = (self.speech_item_id, pause)
        if self.early_transcript is not None:
            if self.early_transcript[0] == key or not self.early_transcript[1].done():
                return
        self.drop_early_transcript()
        audio = self.audio_buffer.peek(self.speech_start_ms)
        self.early_transcript = (key, self.session.start_task(transcribe(self.session.state.client, audio,
                                                                         requester=self.session.requester)))

    def drop_early_transcript(self) -> None:
        if self.early_transcript is not None:
            task = self.early_transcript[1]
            if task.done() and not task.cancelled():
                task.exception()  # seen: a failed early attempt needs no log
            task.cancel()
            self.early_transcript = None

    async def _speech_started(self, start_ms: int, detection: dict) -> None:
        session = self.session
        self.speech_item_id, self.speech_start_ms = new_id("item"), start_ms
        if detection["interrupt_response"]:
            self.barge_ins += 1
        await session.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": start_ms,
                            "item_id": self.speech_item_id})
        playing = session.conversation_response
        if detection["interrupt_response"] and playing is not None and playing not in session.finishing:
            # Barge-in: the answer stops at once (its KV freed, its synthesis cancelled).
            task = session.responses[playing]
            task.cancel()
            await asyncio.wait([task])

    async def _speech_stopped(self, end_ms: int, pause_ms: int, detection: dict) -> None:
        item_id, start_ms = self.speech_item_id, self.speech_start_ms
        early = None
        if self.early_transcript is not None and self.early_transcript[0] == (item_id, pause_ms):
            early = self.early_transcript[1]  # recognized from where this pause began: the same turn
            self.early_transcript = None
        self.drop_early_transcript()
        await self.session.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": end_ms,
                                 "item_id": item_id})
        await self._commit(item_id, start_ms, detection["create_response"], None, early)

    async def commit(self, event: AudioCommit) -> None:
        self._require_audio_in("input_audio_buffer")
        if self.audio_buffer.duration_ms < 100:
            raise InvalidInput(f"the input audio buffer holds {self.audio_buffer.duration_ms} ms of audio; "
                               "a commit needs at least 100 ms", "input_audio_buffer_commit_empty")
        await self._commit(self.speech_item_id or new_id("item"), None, False, event.event_id)

    async def clear(self) -> None:
        self._require_audio_in("input_audio_buffer")
        self.audio_buffer.clear()
        self.reset_turn()
        await self.session.send({"type": "input_audio_buffer.cleared"})

    def reset_turn(self) -> None:
        self.drop_early_transcript()
        self.detector = None  # made afresh, from the next audio on
        self.speech_item_id = self.speech_start_ms = None

    async def _commit(self, item_id: str, from_ms: int | None, create_response: bool,
                      client_event_id: str | None, early: asyncio.Task | None = None) -> None:
        """The buffered turn becomes a user item; its transcript is its text (`early`: its
        recognition, started when the pause that ended it began). The audio is taken now, as
        the buffer goes on with the next turn; the item joins the conversation in its turn and
        is heard off the socket."""
        session = self.session
        audio = self.audio_buffer.take(from_ms)
        if from_ms is None:
            self.reset_turn()  # a manual commit mid-speech starts the next turn afresh
        self.speech_item_id = self.speech_start_ms = None
        # A response started for this turn is interrupted by speech heard from here on.
        barge_ins = self.barge_ins
        if session.conversation.waiting >= self.config.max_queued_events:
            if early is not None:
                early.cancel()
            raise InvalidInput(f"{self.config.max_queued_events} events already wait for this session's earlier work; "
                               "this turn was dropped", "too_many_queued_events")

        async def commit() -> None:
            try:
                await self._commit_turn(item_id, audio, create_response, client_event_id, early, barge_ins)
            except InvalidInput as exc:
                await session.send_error(str(exc), exc.code, exc.param, client_event_id)
            except Exception:
                logger.exception("realtime commit failed")
                await session.send_error("the server failed to commit the audio", "server_error", None,
                                         client_event_id)
            finally:
                if early is not None and not early.done():
                    early.cancel()  # the turn failed before its early transcript was taken

        await session.conversation.run(commit)

    async def _commit_turn(self, item_id: str, audio, create_response: bool, client_event_id: str | None,
                           early: asyncio.Task | None, barge_ins: int) -> None:
        session, history = self.session, self.session.history
        if history.taken(item_id):
            item_id = new_id("item")  # a client item took the id speech_started announced
        history.refuse_when_full(None)
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_audio", "transcript": None}]}
        previous = history.append_turn(item)
        await session.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
        await session.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        if self.hears_audio:
            # The model hears the turn itself: its clip joins the conversation, untranscribed,
            # making room by evicting the oldest audio.
            try:
                self._check_audio_window(len(audio) / RECOGNIZER_RATE, None)
                evicted = history.make_room_for_clips([audio], None)
            except InvalidInput:
                if history.holds(item):
                    history.forget(item_id)
                    await session.send({"type": "conversation.item.deleted", "item_id": item_id})
                raise
            history.heard(item, audio)
            for evicted_id in evicted:
                await session.send({"type": "conversation.item.deleted", "item_id": evicted_id})
            if create_response and history.holds(item):
                await session.on_response_create(ResponseCreate(event_id=client_event_id), barge_ins)
            return
        reporting = self._input_settings["transcription"] is not None
        failure = None
        try:
            text, heard = None, False
            if early is not None:
                try:
                    text, heard = await off_the_socket(early)
                except EngineUnavailable:
                    pass  # the early attempt failed (busy, or the encoder restarted): once more
            if text is None:
                text, heard = await off_the_socket(transcribe(session.state.client, audio,
                                                              requester=session.requester))
            if not heard:
                failure = ("input_audio_no_speech", "no speech was heard in the committed audio")
        except EngineUnavailable as exc:
            failure = ("voice_busy" if isinstance(exc, VoiceBusy) else "engine_unavailable", str(exc))
        if failure is not None:
            code, message = failure
            if reporting:
                await session.send({"type": "conversation.item.input_audio_transcription.failed", "item_id": item_id,
                                    "content_index": 0, "error": {"type": "transcription_error", "code": code,
                                                                  "message": message}})
            if history.holds(item):
                history.forget(item_id)
                await session.send({"type": "conversation.item.deleted", "item_id": item_id})
            raise InvalidInput(message, code)
        # The item may have been deleted (or evicted by an answer) while it was heard.
        history.transcribed(item, text, 1000 * len(audio) / RECOGNIZER_RATE)
        if reporting:
            usage = {"type": "duration", "seconds": round(len(audio) / RECOGNIZER_RATE, 3)}
            await session.send({"type": "conversation.item.input_audio_transcription.delta", "item_id": item_id,
                                "content_index": 0, "delta": text})
            await session.send({"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                                "content_index": 0, "transcript": text, "usage": usage})
        if create_response and history.holds(item):
            await session.on_response_create(ResponseCreate(event_id=client_event_id), barge_ins)

    async def transcribe_parts(self, item: dict) -> tuple[float, list]:
        """conversation.item.create with input_audio parts: each part's transcript is its text
        (the audio itself is not kept), or, where the model hears audio itself, each part's clip
        is kept for it (at RECOGNIZER_RATE). Returns the audio's length in ms and the clips."""
        from engine.audio_formats import resample

        self._require_audio_in("item.content")
        audio_format = self._input_settings["format"]
        heard_ms = 0.0
        clips = []
        for part in item["content"]:
            if part["type"] != "input_audio":
                continue
            samples = decode_client_audio(part.pop("audio"), audio_format["type"], "item.content")
            if len(samples) > self.config.max_audio_buffer_seconds * audio_format["rate"]:
                raise InvalidInput(f"an input_audio part holds at most {self.config.max_audio_buffer_seconds:g} s",
                                   "audio_too_long", "item.content")
            heard_ms += 1000 * len(samples) / audio_format["rate"]
            if self.hears_audio:
                self._check_audio_window(len(samples) / audio_format["rate"], "item.content")
                part["transcript"] = None
                clips.append(resample(samples, audio_format["rate"], RECOGNIZER_RATE))
                continue
            try:
                text, heard = await transcribe(self.session.state.client,
                                               resample(samples, audio_format["rate"], RECOGNIZER_RATE),
                                               requester=self.session.requester)
            except EngineUnavailable as exc:
                raise InvalidInput(str(exc), "engine_unavailable", "item.content") from None
            if not heard:
                raise InvalidInput("no speech was heard in an input_audio part", "input_audio_no_speech",
                                   "item.content")
            part["transcript"] = text
        return heard_ms, clips
