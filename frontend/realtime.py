"""One Realtime API WebSocket connection: OpenAI Realtime events over a kept conversation.

Client events: session.update, conversation.item.create / .delete / .retrieve / .truncate,
response.create, response.cancel (GA names; beta field names such as
max_response_output_tokens and "text" content parts are accepted too), each decoded into a
typed struct at the socket. Server events: session.created/updated, conversation.item.added
/ .deleted / .retrieved,
response.created, response.output_item.added, response.content_part.added,
response.output_text.delta/done, response.content_part.done, response.output_item.done,
response.done (with usage and cached-token counts) and error.

A response bound to the conversation (the default) appends its answer to the history; only
one runs at a time. Responses with "conversation": "none" run beside it on their own input.
Any bad event gets an `error` event with a code and the connection carries on. The
conversation holds at most max_conversation_items items and max_conversation_bytes of text
(the session's instructions included); an answer that would take it past either evicts the
oldest items (each with conversation.item.deleted). A connection may send at most
max_events_per_second events (bursts of twice that).

A response.cancel stops a response that is still generating. Once a response starts
finishing (its stream ended, failed or was cancelled), a cancel leaves it alone, so its
closing events (output_*.done, response.done) always go out and its answer joins the history.

The session never stops reading its socket while work for it runs (frontend/realtime_work.py):
events are handled, and answered, in order, but a transcription (which waits on the encoder
and on every other client's clips) and the turn detector's model go on while the next events
are read. Meanwhile, conversation events (items, response.create, the items commits make) wait
for the conversation's work before them; session and audio events wait only for theirs, so a
session.update, input_audio_buffer.append or .clear is handled while a turn is still being
recognized; a response.cancel is handled at once (unless it names no response and follows a
response.create of its own still waiting, which it then waits for, as it always did). At most
max_queued_events events wait at once. Templating, counting and grammar checks are bounded
(the prompt limit, the compile deadline) and run in threads, in the events' order.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import uuid

import anyio
import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from engine.audio_windows import RECOGNIZER_RATE
from engine.sampling_params import SamplingParams
from frontend.admission import AdmissionRefused, RequestLease
from frontend.chat_request import sampling_params_or_invalid
from frontend.edge_decoding import InvalidInput
from frontend.engine_client import EngineUnavailable, VoiceBusy
from frontend.limits import EventRate
from frontend.realtime_audio import (InputAudioBuffer, decode_client_audio, default_audio_settings,
                                     encode_client_audio, merged_audio_settings, new_turn_detector)
from frontend.speech_recognition import transcribe
from frontend.structured_output import GrammarBusy
from frontend.realtime_tools import FunctionCallStream, chat_tools, check_tools, constraint_of, conversation_messages
from frontend.realtime_events import (UNSUPPORTED_SESSION_FIELDS, AudioAppend, AudioClear, AudioCommit, ItemCreate, ItemDelete, ItemRetrieve,
                                      ItemTruncate, MessageItem, ResponseCancel, ResponseCreate, SessionSettings,
                                      SessionUpdate, decode_client_event)
from frontend.realtime_work import OrderedWork, off_the_socket
from frontend.tenancy import ANONYMOUS, Requester

logger = logging.getLogger("antiphon.realtime")


AUDIO_MS_PER_TOKEN = 100
# Seconds of audio a session may send at once, past its --max-audio-speedup rate.
AUDIO_BURST_S = 30.0
# Recognition of a turn starts this long before its pause would end it: about what Whisper
# takes for a short question here, so the transcript is ready as the turn ends.
EARLY_LEAD_MS = 250
# Tokens by which an item's text counted alone may exceed its share of the templated prompt:
# where the text meets the template's own text one token may cover bytes of both, at each end.
# With it, the conversation's count is a lower bound, and a response.create refused on it
# would have been refused after templating too.
EDGE_TOKENS = 2
# Conversation events: they wait for the conversation work before them (see the docstring).
CONVERSATION_EVENTS = (ItemCreate, ItemDelete, ItemRetrieve, ItemTruncate, ResponseCreate, ResponseCancel)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class RealtimeSession:
    def __init__(self, websocket: WebSocket, state, cache_salt: str | None = None,
                 requester: Requester = ANONYMOUS) -> None:
        self.ws = websocket
        self.state = state
        self.config = state.config
        self.cache_salt = cache_salt
        # Who the session is, for its share of the work shared by every client (transcriptions,
        # spoken answers).
        self.requester = requester
        self.session = {
            "id": new_id("sess"), "object": "realtime.session", "type": "realtime", "model": state.model_name,
            "output_modalities": ["text"], "instructions": "", "max_output_tokens": "inf",
            "temperature": 0.8, "top_p": 1.0, "seed": None, "audio": default_audio_settings(),
            "tools": [], "tool_choice": "auto", "include": None,
        }
        # Voice: the input audio buffer, the turn detector (server VAD, made when first needed),
        # the turn the user is speaking now (its item id and start), and for each spoken
        # answer the clauses heard, with their audio length in ms (for item.truncate).
        self.audio_buffer = InputAudioBuffer(self.config.max_audio_buffer_seconds)
        self.detector = None
        self.detector_offset_ms = 0.0
        self.speech_item_id: str | None = None
        self.speech_start_ms: int | None = None
        self.spoken: dict[str, list[tuple[str, float]]] = {}
        # How much audio each user item was, in ms: usage counts it.
        self.heard_ms: dict[str, float] = {}
        # The turn's recognition started early, when a pause began: ((item id, pause start), task).
        self.early_transcript: tuple[tuple[str, int], asyncio.Task] | None = None
        # The conversation, in order, by item id, and the bytes of its text and instructions.
        self.items: dict[str, dict] = {}
        self.conversation_bytes = 0
        # At least how many tokens each item's text takes, and the instructions' (text, count):
        # a conversation past the prompt limit is refused without templating it again.
        self.item_tokens: dict[str, int] = {}
        self.instruction_tokens: tuple[str, int] = ("", 0)
        # Ids the server announced for items not in the conversation yet (an answer's, its
        # calls'): a client item may not take them.
        self.announced_ids: set[str] = set()
        self.responses: dict[str, asyncio.Task] = {}
        # Responses sending their closing events: a cancel no longer reaches them.
        self.finishing: set[str] = set()
        self.conversation_response: str | None = None
        # Events in order, and the conversation's work in order (frontend/realtime_work.py);
        # response.create events read and not yet handled; speech starts that interrupt answers
        # (an answer asked for before one is cancelled as it starts, as if it had been playing).
        self.inbox = OrderedWork()
        self.conversation = OrderedWork()
        self.creates_waiting = 0
        self.barge_ins = 0
        # Tasks of the session besides its responses and its ordered work (early transcripts).
        self.tasks: set[asyncio.Task] = set()
        self.last_activity = time.monotonic()
        self.rate = EventRate(self.config.max_events_per_second)
        self.audio_rate = EventRate(self.config.max_audio_speedup, capacity=AUDIO_BURST_S)
        self.send_lock = asyncio.Lock()
        # Event ids go out with every token: the session's random id plus a counter is as
        # unique as a fresh uuid4 per event, without a urandom call on the hot path.
        self._event_ids = (f"event_{self.session['id'][5:]}_{n}" for n in itertools.count())

    # ---- connection ---------------------------------------------------------------------

    @property
    def _takes_images(self) -> bool:
        return getattr(self.state.generation, "adapter", None) is not None

    async def run(self) -> None:
        watchdog = asyncio.create_task(self._close_when_idle())
        try:
            await self.send({"type": "session.created", "session": self.session})
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self.last_activity = time.monotonic()
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                await self._handle_raw(data)
        except WebSocketDisconnect:
            pass
        finally:
            watchdog.cancel()
            # Pending work first: none of it may start a response after the cancels below.
            await self.inbox.close()
            await self.conversation.close()
            self._drop_early_transcript()
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(watchdog, *self.tasks, return_exceptions=True)
            # A client that goes away mid-stream frees its requests and KV blocks at once.
            for response_id, task in list(self.responses.items()):
                if response_id not in self.finishing:
                    task.cancel()
            if self.responses:
                await asyncio.gather(*self.responses.values(), return_exceptions=True)

    async def _close_when_idle(self) -> None:
        timeout = self.config.idle_timeout_s
        while True:
            await asyncio.sleep(min(timeout, 1.0))
            working = self.responses or self.inbox.busy or self.conversation.busy
            if not working and time.monotonic() - self.last_activity > timeout:
                await self.send_error(f"closed after {timeout:g} s without activity", "idle_timeout")
                await self.ws.close(code=1000, reason="idle timeout")
                return

    def _start_task(self, coroutine) -> asyncio.Task:
        """A task of the session's own, cancelled and awaited when the session closes."""
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _handle_raw(self, data: str | bytes) -> None:
        if not self.rate.allow():
            await self.send_error(f"more than {self.config.max_events_per_second:g} events per second; "
                                  "this one was dropped", "rate_limit_exceeded")
            return
        size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", errors="surrogatepass"))
        if size > self.config.max_message_bytes:
            await self.send_error(f"message over {self.config.max_message_bytes} bytes", "message_too_large")
            return
        try:
            event = decode_client_event(data, self.config.accept_unknown_fields)
        except InvalidInput as exc:
            await self.send_error(str(exc), exc.code, exc.param, getattr(exc, "event_id", None))
            return
        if isinstance(event, ResponseCancel) and (event.response_id is not None or not self.creates_waiting):
            # A cancel stops what runs now, whatever waits on slow work.
            await self._apply(event)
            return
        if self.inbox.waiting + self.conversation.waiting >= self.config.max_queued_events:
            await self.send_error(f"{self.config.max_queued_events} events already wait for this session's earlier "
                                  "work (a transcription, say); this one was dropped", "too_many_queued_events",
                                  None, event.event_id)
            return
        if isinstance(event, ResponseCreate):
            self.creates_waiting += 1
        await self.inbox.run(lambda: self._handle(event))

    async def _handle(self, event) -> None:
        """One event, in the order events came; a conversation event then also in the order of
        the conversation's work."""
        if not isinstance(event, CONVERSATION_EVENTS):
            await self._apply(event)
        elif isinstance(event, ResponseCreate):
            # Speech heard from here on interrupts this response (see barge_ins).
            barge_ins = self.barge_ins
            await self.conversation.run(lambda: self._apply(event, self.on_response_create(event, barge_ins)))
        else:
            await self.conversation.run(lambda: self._apply(event))

    async def _apply(self, event, handling=None) -> None:
        """Handles `event` (or awaits `handling`, its handler already called); a bad event, or
        a failure of ours, is an error event, and the session goes on."""
        try:
            await (handling if handling is not None else self.handlers[type(event)](self, event))
        except InvalidInput as exc:
            await self.send_error(str(exc), exc.code, exc.param, event.event_id)
        except Exception:
            # A bug of ours must not take the connection (and its other responses) down.
            logger.exception("realtime event failed")
            await self.send_error("the server failed to handle this event", "server_error", None, event.event_id)
        finally:
            if isinstance(event, ResponseCreate) and handling is not None:
                self.creates_waiting -= 1

    # ---- client events ----------------------------------------------------------------------

    async def on_session_update(self, event: SessionUpdate) -> None:
        update = _settings(event.session, "session")
        if "audio" in update.get("output_modalities", ()):
            self._require_voice("session.output_modalities")
        _check_modalities(update, "session.output_modalities")
        candidate = {**self.session, **update, "audio": merged_audio_settings(self.session["audio"], event.session)}
        _sampling(candidate, {}, self.config.default_max_tokens)  # validates before anything changes
        await self._check_answer_settings(candidate, "session")
        # Instructions are templated into every response, like the items: they share the budget.
        grown = _text_bytes(candidate["instructions"]) - _text_bytes(self.session["instructions"])
        if self.conversation_bytes + grown > self.config.max_conversation_bytes:
            raise InvalidInput(f"the instructions and the conversation would hold more than "
                               f"{self.config.max_conversation_bytes} bytes of text; shorten them or delete "
                               "items with conversation.item.delete", "conversation_full", "session.instructions")
        if candidate["audio"]["input"]["turn_detection"] != self.session["audio"]["input"]["turn_detection"]:
            self._reset_turn()  # the detector is made again with the new settings, from the next audio on
        self.session = candidate
        self.conversation_bytes += grown
        await self.send({"type": "session.updated", "session": self.session})

    async def on_item_create(self, event: ItemCreate) -> None:
        item = _message_item(event.item, self._takes_images)
        previous = event.previous_item_id
        self._check_new_item(item, previous)
        heard_ms = 0.0
        # Recognized only once the cheap checks pass; an answer may join the conversation (and
        # evict items) while the audio is heard, so they are made again after it.
        if any(part["type"] == "input_audio" for part in item.get("content", ())):
            heard_ms = await off_the_socket(self._transcribe_parts(item))
            self._check_new_item(item, previous)
        size = _item_bytes(item)
        if self.conversation_bytes + size > self.config.max_conversation_bytes:
            raise InvalidInput(f"the conversation would hold more than {self.config.max_conversation_bytes} bytes "
                               "of text (instructions included); delete some items with conversation.item.delete",
                               "conversation_full", "item")
        self.items = _insert_after(self.items, item, previous)
        if heard_ms:
            self.heard_ms[item["id"]] = heard_ms
        self.conversation_bytes += size
        await self.send({"type": "conversation.item.added", "previous_item_id": _previous_id(self.items, item["id"]),
                         "item": item})

    def _check_new_item(self, item: dict, previous: str | None) -> None:
        """A client item may join the conversation after `previous` ("root": first; None: last)."""
        if len(self.items) >= self.config.max_conversation_items:
            raise InvalidInput(f"the conversation holds its limit of {self.config.max_conversation_items} items; "
                               "delete some with conversation.item.delete", "conversation_full", "item")
        item_id = item["id"]
        if item_id == "root":
            # previous_item_id "root" means the start of the conversation: an item so named
            # could not be inserted after.
            raise InvalidInput("'root' names the start of the conversation (previous_item_id); it is not an "
                               "item id", "invalid_value", "item.id")
        if item_id in self.items or item_id in self.announced_ids:
            raise InvalidInput(f"an item with id {item_id!r} already exists", "duplicate_item_id", "item.id")
        if previous is not None and previous != "root" and previous not in self.items:
            raise InvalidInput(f"no item with id {previous!r}", "item_not_found", "previous_item_id")
        ordered = list(self.items.values())
        earlier = (ordered if previous is None else [] if previous == "root"
                   else ordered[:list(self.items).index(previous) + 1])
        _check_call_id(item, earlier, ordered)

    def _forget_item(self, item_id: str) -> dict:
        """Takes an item out of the conversation, with what the session knows of it."""
        item = self.items.pop(item_id)
        self.conversation_bytes -= _item_bytes(item)
        self.spoken.pop(item_id, None)
        self.heard_ms.pop(item_id, None)
        self.item_tokens.pop(item_id, None)
        return item

    async def on_item_delete(self, event: ItemDelete) -> None:
        if event.item_id not in self.items:
            raise InvalidInput(f"no item with id {event.item_id!r}", "item_not_found", "item_id")
        self._forget_item(event.item_id)
        await self.send({"type": "conversation.item.deleted", "item_id": event.item_id})

    async def on_item_retrieve(self, event: ItemRetrieve) -> None:
        item = self.items.get(event.item_id)
        if item is None:
            raise InvalidInput(f"no item with id {event.item_id!r}", "item_not_found", "item_id")
        await self.send({"type": "conversation.item.retrieved", "item": item})

    async def on_item_truncate(self, event: ItemTruncate) -> None:
        item = self.items.get(event.item_id)
        if item is None:
            raise InvalidInput(f"no item with id {event.item_id!r}", "item_not_found", "item_id")
        clauses = self.spoken.get(event.item_id)
        # Truncation cuts an assistant item's audio at what the user heard; text items
        # have no audio to cut.
        if clauses is None or event.content_index != 0:
            raise InvalidInput("only audio content can be truncated, and this item has none there",
                               "invalid_value", "content_index")
        total_ms = sum(ms for _, ms in clauses)
        if event.audio_end_ms > total_ms:
            raise InvalidInput(f"audio_end_ms {event.audio_end_ms} is past the item's audio ({total_ms:.0f} ms)",
                               "invalid_value", "audio_end_ms")
        heard = _heard_transcript(clauses, event.audio_end_ms)
        part = item["content"][0]
        self.conversation_bytes += _text_bytes(heard) - _text_bytes(part["transcript"])
        part["transcript"] = heard
        self.item_tokens.pop(event.item_id, None)
        self.spoken[event.item_id] = [(heard, float(event.audio_end_ms))]
        await self.send({"type": "conversation.item.truncated", "item_id": event.item_id, "content_index": 0,
                         "audio_end_ms": event.audio_end_ms})

    # ---- input audio ------------------------------------------------------------------------

    def _require_voice(self, param: str) -> None:
        if not self.state.engine_config.voice:
            raise InvalidInput("voice is off on this server (started with --no-voice)", "unsupported_modality", param)

    async def on_audio_append(self, event: AudioAppend) -> None:
        self._require_voice("audio")
        settings = self.session["audio"]["input"]
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
        if pause is None or self.speech_item_id is None:
            self._drop_early_transcript()
            return
        # Not at every gap between words: only a pause already close to ending the turn, and
        # one attempt at a time per session (the encoder finishes what it started anyway).
        lead = max(0, self.session["audio"]["input"]["turn_detection"]["silence_duration_ms"] - EARLY_LEAD_MS)
        if detector.position_ms - pause < lead:
            return
        key = (self.speech_item_id, pause)
        if self.early_transcript is not None:
            if self.early_transcript[0] == key or not self.early_transcript[1].done():
                return
        self._drop_early_transcript()
        audio = self.audio_buffer.peek(self.speech_start_ms)
        self.early_transcript = (key, self._start_task(transcribe(self.state.client, audio,
                                                                  requester=self.requester)))

    def _drop_early_transcript(self) -> None:
        if self.early_transcript is not None:
            task = self.early_transcript[1]
            if task.done() and not task.cancelled():
                task.exception()  # seen: a failed early attempt needs no log
            task.cancel()
            self.early_transcript = None

    async def _speech_started(self, start_ms: int, detection: dict) -> None:
        self.speech_item_id, self.speech_start_ms = new_id("item"), start_ms
        if detection["interrupt_response"]:
            self.barge_ins += 1
        await self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": start_ms,
                         "item_id": self.speech_item_id})
        playing = self.conversation_response
        if detection["interrupt_response"] and playing is not None and playing not in self.finishing:
            # Barge-in: the answer stops at once (its KV freed, its synthesis cancelled).
            task = self.responses[playing]
            task.cancel()
            await asyncio.wait([task])

    async def _speech_stopped(self, end_ms: int, pause_ms: int, detection: dict) -> None:
        item_id, start_ms = self.speech_item_id, self.speech_start_ms
        early = None
        if self.early_transcript is not None and self.early_transcript[0] == (item_id, pause_ms):
            early = self.early_transcript[1]  # recognized from where this pause began: the same turn
            self.early_transcript = None
        self._drop_early_transcript()
        await self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": end_ms, "item_id": item_id})
        await self._commit(item_id, start_ms, detection["create_response"], None, early)

    async def on_audio_commit(self, event: AudioCommit) -> None:
        self._require_voice("input_audio_buffer")
        if self.audio_buffer.duration_ms < 100:
            raise InvalidInput(f"the input audio buffer holds {self.audio_buffer.duration_ms} ms of audio; "
                               "a commit needs at least 100 ms", "input_audio_buffer_commit_empty")
        await self._commit(self.speech_item_id or new_id("item"), None, False, event.event_id)

    async def on_audio_clear(self, event: AudioClear) -> None:
        self._require_voice("input_audio_buffer")
        self.audio_buffer.clear()
        self._reset_turn()
        await self.send({"type": "input_audio_buffer.cleared"})

    def _reset_turn(self) -> None:
        self._drop_early_transcript()
        self.detector = None  # made afresh, from the next audio on
        self.speech_item_id = self.speech_start_ms = None

    async def _commit(self, item_id: str, from_ms: int | None, create_response: bool,
                      client_event_id: str | None, early: asyncio.Task | None = None) -> None:
        """The buffered turn becomes a user item; its transcript is its text (`early`: its
        recognition, started when the pause that ended it began). The audio is taken now, as
        the buffer goes on with the next turn; the item joins the conversation in its turn and
        is heard off the socket."""
        audio = self.audio_buffer.take(from_ms)
        if from_ms is None:
            self._reset_turn()  # a manual commit mid-speech starts the next turn afresh
        self.speech_item_id = self.speech_start_ms = None
        # A response started for this turn is interrupted by speech heard from here on.
        barge_ins = self.barge_ins
        if self.conversation.waiting >= self.config.max_queued_events:
            if early is not None:
                early.cancel()
            raise InvalidInput(f"{self.config.max_queued_events} events already wait for this session's earlier work; "
                               "this turn was dropped", "too_many_queued_events")

        async def commit() -> None:
            try:
                await self._commit_turn(item_id, audio, create_response, client_event_id, early, barge_ins)
            except InvalidInput as exc:
                await self.send_error(str(exc), exc.code, exc.param, client_event_id)
            except Exception:
                logger.exception("realtime commit failed")
                await self.send_error("the server failed to commit the audio", "server_error", None, client_event_id)
            finally:
                if early is not None and not early.done():
                    early.cancel()  # the turn failed before its early transcript was taken

        await self.conversation.run(commit)

    async def _commit_turn(self, item_id: str, audio, create_response: bool, client_event_id: str | None,
                           early: asyncio.Task | None, barge_ins: int) -> None:
        if item_id in self.items or item_id in self.announced_ids:
            item_id = new_id("item")  # a client item took the id speech_started announced
        if len(self.items) >= self.config.max_conversation_items:
            raise InvalidInput(f"the conversation holds its limit of {self.config.max_conversation_items} items; "
                               "delete some with conversation.item.delete", "conversation_full")
        previous = next(reversed(self.items), None)
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_audio", "transcript": None}]}
        self.items[item_id] = item
        await self.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
        await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item})
        reporting = self.session["audio"]["input"]["transcription"] is not None
        failure = None
        try:
            text, heard = None, False
            if early is not None:
                try:
                    text, heard = await off_the_socket(early)
                except EngineUnavailable:
                    pass  # the early attempt failed (busy, or the encoder restarted): once more
            if text is None:
                text, heard = await off_the_socket(transcribe(self.state.client, audio, requester=self.requester))
            if not heard:
                failure = ("input_audio_no_speech", "no speech was heard in the committed audio")
        except EngineUnavailable as exc:
            failure = ("voice_busy" if isinstance(exc, VoiceBusy) else "engine_unavailable", str(exc))
        if failure is not None:
            code, message = failure
            if reporting:
                await self.send({"type": "conversation.item.input_audio_transcription.failed", "item_id": item_id,
                                 "content_index": 0, "error": {"type": "transcription_error", "code": code,
                                                               "message": message}})
            if self.items.get(item_id) is item:
                self._forget_item(item_id)
                await self.send({"type": "conversation.item.deleted", "item_id": item_id})
            raise InvalidInput(message, code)
        item["content"][0]["transcript"] = text
        # The item may have been deleted (or evicted by an answer) while it was heard.
        if self.items.get(item_id) is item:
            self.conversation_bytes += _text_bytes(text)
            self.heard_ms[item_id] = 1000 * len(audio) / RECOGNIZER_RATE
            self.item_tokens.pop(item_id, None)
        if reporting:
            usage = {"type": "duration", "seconds": round(len(audio) / RECOGNIZER_RATE, 3)}
            await self.send({"type": "conversation.item.input_audio_transcription.delta", "item_id": item_id,
                             "content_index": 0, "delta": text})
            await self.send({"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                             "content_index": 0, "transcript": text, "usage": usage})
        if create_response and self.items.get(item_id) is item:
            await self.on_response_create(ResponseCreate(event_id=client_event_id), barge_ins)

    async def _transcribe_parts(self, item: dict) -> float:
        """conversation.item.create with input_audio parts: each part's transcript is its text
        (the audio itself is not kept). Returns the audio's length in ms."""
        from engine.audio_formats import resample

        self._require_voice("item.content")
        audio_format = self.session["audio"]["input"]["format"]
        heard_ms = 0.0
        for part in item["content"]:
            if part["type"] != "input_audio":
                continue
            samples = decode_client_audio(part.pop("audio"), audio_format["type"], "item.content")
            if len(samples) > self.config.max_audio_buffer_seconds * audio_format["rate"]:
                raise InvalidInput(f"an input_audio part holds at most {self.config.max_audio_buffer_seconds:g} s",
                                   "audio_too_long", "item.content")
            try:
                text, heard = await transcribe(self.state.client,
                                               resample(samples, audio_format["rate"], RECOGNIZER_RATE),
                                               requester=self.requester)
            except EngineUnavailable as exc:
                raise InvalidInput(str(exc), "engine_unavailable", "item.content") from None
            if not heard:
                raise InvalidInput("no speech was heard in an input_audio part", "input_audio_no_speech",
                                   "item.content")
            part["transcript"] = text
            heard_ms += 1000 * len(samples) / audio_format["rate"]
        return heard_ms

    async def on_response_create(self, event: ResponseCreate, barge_ins: int | None = None) -> None:
        """Starts a response. `barge_ins`: self.barge_ins when it was asked for; speech that
        started since then cancels it as it starts (it would have been playing)."""
        # The settings as this event found them: a session.update may land while a turn this
        # response waited for was heard.
        session = self.session
        options = event.response
        out_of_band = options.conversation == "none"
        if not out_of_band and self.conversation_response is not None:
            raise InvalidInput("the conversation already has an active response; cancel it or wait",
                               "conversation_already_has_active_response")
        if len(self.responses) >= self.config.max_concurrent_per_connection:
            raise InvalidInput(f"at most {self.config.max_concurrent_per_connection} responses at once "
                               "on one connection", "too_many_responses")
        overrides = _settings(options, "response")
        _check_modalities(overrides, "response.output_modalities")
        speaking = "audio" in overrides.get("output_modalities", session["output_modalities"])
        if speaking:
            self._require_voice("response.output_modalities")
            if not self.state.client.voice_ready:
                raise InvalidInput(f"voice is unavailable: {self.state.client.voice_status}", "voice_unavailable")
        audio_out = merged_audio_settings(session["audio"], options)["output"] if speaking else None
        own_input = out_of_band and options.input is not msgspec.UNSET
        if own_input:
            items = [_message_item(i, self._takes_images) for i in options.input]
            for at, item in enumerate(items):
                _check_call_id(item, items[:at], items, "response.input")
        else:
            items = list(self.items.values())
        params = _sampling(session, overrides, self.config.default_max_tokens, "response")
        settings = {**session, **overrides}
        constraint = await self._check_answer_settings(settings, "response")
        if constraint is not None:
            params = msgspec.structs.replace(params, structured_output=constraint[0])
        if "response.output_text.logprobs" in (settings["include"] or ()):
            params = msgspec.structs.replace(params, logprobs=0)
        tools = chat_tools(settings["tools"]) or None
        calls_tools = tools is not None and settings["tool_choice"] != "none"
        instructions = settings["instructions"]
        if not own_input:
            # The kept conversation costs the client nothing to send again: refuse one past the
            # prompt limit on counts kept per item, before templating it.
            await self._refuse_past_prompt_limit(items, instructions)
        messages = ([{"role": "system", "content": instructions}] if instructions else [])
        messages += conversation_messages(items, _item_content)
        try:
            lease = self.state.generation.admit(new_id("resp"))
        except AdmissionRefused as exc:
            raise InvalidInput(str(exc), exc.code) from None
        try:
            # Templated only once admitted: a flood of requests costs no template work.
            prompt = await self.state.generation.chat_prompt(messages, tools)
        except BaseException:
            lease.release()
            raise
        response_id = lease.request_id
        heard_ms = sum(self.heard_ms.get(i["id"], 0.0) for i in items)
        metadata = None if options.metadata is msgspec.UNSET else options.metadata
        task = asyncio.create_task(self._respond(lease, prompt, params, not out_of_band, event.event_id, audio_out,
                                                 heard_ms, calls_tools, metadata))
        # Bookkeeping that must happen however the task ends, even if it is cancelled
        # before it starts (a response.cancel right behind the response.create).
        lease.bind(task)
        task.add_done_callback(lambda _: self._forget_response(response_id))
        self.responses[response_id] = task
        if not out_of_band:
            self.conversation_response = response_id
        # Let the task start (and enter its try block) before the next client event is read:
        # a task cancelled before its first step would never send its response.done. (Its lease
        # does not depend on this: `bind` releases it however the task ends.)
        await asyncio.sleep(0)
        spoke_up = barge_ins is not None and barge_ins != self.barge_ins
        if spoke_up and not out_of_band and response_id not in self.finishing:
            task.cancel()  # the user spoke up while it was being prepared: a barge-in as it starts

    async def _check_answer_settings(self, settings: dict, where: str) -> tuple | None:
        """Tools, tool_choice, response_format and include of a session or a response, checked
        (grammars compiled off the loop); the constraint its answers get, if any."""
        for value in settings["include"] or ():
            if value != "response.output_text.logprobs":
                raise InvalidInput(f"include {value!r} is not supported by this server (it can include "
                                   "'response.output_text.logprobs')", "unsupported_parameter", f"{where}.include")
        check_tools(settings, where, self.config.max_tools)
        constraint = await constraint_of(settings, where, self.config.max_grammar_bytes)
        if constraint is not None:
            try:
                await self.state.grammar_checker.check(*constraint, self.requester)
            except GrammarBusy as exc:
                raise InvalidInput(str(exc), "grammar_busy", constraint[1]) from None
        return constraint

    async def _refuse_past_prompt_limit(self, items: list[dict], instructions: str) -> None:
        """Refuses the conversation when its text alone is past the prompt limit. Each item is
        counted once (off the loop) and remembered, so that asking again and again for a
        response to a conversation too long costs nothing but the sum."""
        generation = self.state.generation
        uncounted = [item for item in items if item["id"] not in self.item_tokens]
        texts = [_item_text(item) for item in uncounted]
        new_instructions = instructions != self.instruction_tokens[0]
        if new_instructions:
            texts.append(instructions)
        if texts:
            counts = await anyio.to_thread.run_sync(_least_tokens, generation, texts)
            for item, count in zip(uncounted, counts):
                if self.items.get(item["id"]) is item:  # not deleted or evicted meanwhile
                    self.item_tokens[item["id"]] = count
            if new_instructions:
                self.instruction_tokens = (instructions, counts[-1])
        least = sum(max(0, self.item_tokens.get(item["id"], 0) - EDGE_TOKENS) for item in items)
        least += max(0, self.instruction_tokens[1] - EDGE_TOKENS) if instructions else 0
        if least > generation.max_prompt_tokens:
            raise InvalidInput(f"the conversation is at least {least} tokens; a prompt may have "
                               f"{generation.max_prompt_tokens}: delete items with conversation.item.delete",
                               "prompt_too_long")

    def _forget_response(self, response_id: str) -> None:
        self.responses.pop(response_id, None)
        self.finishing.discard(response_id)
        if self.conversation_response == response_id:
            self.conversation_response = None

    async def on_response_cancel(self, event: ResponseCancel) -> None:
        response_id = event.response_id or self.conversation_response
        task = self.responses.get(response_id) if response_id else None
        if task is None:
            raise InvalidInput("there is no active response to cancel", "response_cancel_not_active",
                               "response_id")
        if response_id not in self.finishing:
            task.cancel()
        # Either way the response's response.done goes out before the next event is handled.
        # (wait, unlike gather, never cancels the response if this handler is cancelled.)
        await asyncio.wait([task])

    handlers = {
        SessionUpdate: on_session_update,
        ItemCreate: on_item_create,
        ItemDelete: on_item_delete,
        ItemRetrieve: on_item_retrieve,
        ItemTruncate: on_item_truncate,
        ResponseCreate: on_response_create,
        ResponseCancel: on_response_cancel,
        AudioAppend: on_audio_append,
        AudioCommit: on_audio_commit,
        AudioClear: on_audio_clear,
    }

    # ---- one response ---------------------------------------------------------------------

    async def _respond(self, lease: RequestLease, prompt: list[int], params: SamplingParams,
                       in_conversation: bool, client_event_id: str | None, audio_out: dict | None = None,
                       heard_ms: float = 0.0, calls_tools: bool = False, metadata: dict | None = None) -> None:
        response_id = lease.request_id
        # The ids of the output items, announced before they join the conversation (at the end).
        announced: list[str] = []

        def announce() -> str:
            announced.append(new_id("item"))
            self.announced_ids.add(announced[-1])
            return announced[-1]

        # Function calls the answer makes become output items of their own, after the message.
        calls = FunctionCallStream(self.send, response_id, announce) if calls_tools else None
        # A spoken answer: its text goes to the talker as it comes and out as the audio's
        # transcript; its audio is pumped to the client by a task of its own.
        speaking = audio_out is not None
        client = self.state.client if speaking else None
        item = {"id": announce(), "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        # `metadata` is the response.create's, echoed: a client tells its own responses from
        # those server VAD starts by it.
        response = {"id": response_id, "object": "realtime.response", "status": "in_progress",
                    "status_details": None, "output": [], "output_modalities": ["audio" if speaking else "text"],
                    "usage": None, "metadata": metadata,
                    "conversation_id": self.session["id"] if in_conversation else None}
        where = {"response_id": response_id, "item_id": item["id"], "output_index": 0, "content_index": 0}
        opening = [{"type": "response.created", "response": response},
                   {"type": "response.output_item.added", "response_id": response_id, "output_index": 0,
                    "item": item},
                   {"type": "response.content_part.added", **where,
                    "part": {"type": "output_audio", "transcript": ""} if speaking else {"type": "output_text",
                                                                                         "text": ""}}]
        # How many opening events went out: a cancel may land between any two of them (an
        # event whose send is cancelled was not written), and the closing events match them.
        opened = 0
        text, last, error = "", None, None
        clauses: list[tuple[str, float]] = []
        pump = None
        if speaking:
            rate, speed = audio_out["format"]["rate"], audio_out["speed"]
            try:
                speech = client.open_speech(response_id, requester=self.requester)
            except EngineUnavailable as exc:
                code = "voice_busy" if isinstance(exc, VoiceBusy) else "voice_unavailable"
                speech, error = None, ("server_error", code, str(exc))
            if speech is not None:
                pump = asyncio.create_task(self._pump_audio(speech, where, audio_out["format"]["type"], clauses))
        stream = self.state.generation.stream(lease, prompt, params, self.cache_salt)
        # Submit the engine request first and announce the response while the prefill runs:
        # the opening events are not on the way to the first token. Sending them does not
        # yield to the loop, so without this sleep(0) the task would submit only after all
        # three (measured: 0.5 ms of TTFT).
        first = asyncio.create_task(anext(stream, None))
        try:
            await asyncio.sleep(0)
            for event in opening:
                await self.send(event)
                opened += 1
            if speaking and pump is None:
                raise _VoiceFailed(error[2], error[1])
            chunk = await first
            while chunk is not None:
                last = chunk
                said = chunk.text
                if calls is not None:
                    said = await calls.feed(chunk.text, final=chunk.finish_reason is not None)
                if said:
                    text += said
                    if speaking:
                        if pump.done():  # the talker failed: the answer cannot be spoken
                            raise _VoiceFailed(pump.result() or "speech ended early")
                        await self.send({"type": "response.output_audio_transcript.delta", **where,
                                         "delta": said})
                        await self._speak(response_id, said, False, rate, speed)
                # Logprobs go with text that is shown as it is (not a tool call's, not held back).
                with_logprobs = params.logprobs is not None and chunk.token_ids and said == chunk.text
                if not speaking and (said or with_logprobs):
                    delta = {"type": "response.output_text.delta", **where, "delta": said}
                    if with_logprobs:
                        delta["logprobs"] = self._logprobs(chunk)
                    await self.send(delta)
                chunk = await anext(stream, None)
            if speaking:
                await self._speak(response_id, "", True, rate, speed)
                # The decoder is done: its admission slot is free while the audio plays out.
                await stream.aclose()
                lease.release()
                failure = await pump  # every clause sent: the answer is complete when its audio is
                if failure is not None:
                    raise _VoiceFailed(failure)
            response["status"] = {"stop": "completed", "length": "incomplete"}.get(last.finish_reason, "failed")
            if last.finish_reason == "length":
                response["status_details"] = {"type": "incomplete", "reason": "max_output_tokens"}
            elif response["status"] == "failed":
                error = ("server_error", "engine_error", last.error or "generation failed")
        except EngineUnavailable as exc:
            error = ("server_error", "engine_unavailable", str(exc))
        except _VoiceFailed as exc:
            error = ("server_error", exc.code, str(exc))
        except asyncio.CancelledError:
            response["status"] = "cancelled"
            response["status_details"] = {"type": "cancelled", "reason": "client_cancelled"}
        except Exception as exc:
            # Never leave a response in_progress: whatever broke, the client hears of it.
            logger.exception("response %s failed", response_id)
            error = ("server_error", "server_error", str(exc))
        finally:
            # From here on a response.cancel leaves this response alone: nothing may cut the
            # closing events below (set before the first await, so no cancel slips in).
            self.finishing.add(response_id)
            if first.done():
                if not first.cancelled():
                    first.exception()  # seen, so asyncio does not log it as never retrieved
            else:
                # Cancelled before the first chunk: stop the pending step, whose cleanup aborts
                # the engine request.
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
            await stream.aclose()  # a no-op if the stream already ended
            lease.release()
            if speaking:
                client.cancel_speech(response_id)  # a no-op once its audio is complete
                if pump is not None and not pump.done():
                    pump.cancel()
                    await asyncio.gather(pump, return_exceptions=True)
            if error is not None:
                kind, code, message = error
                response["status"] = "failed"
                response["status_details"] = {"type": "failed",
                                              "error": {"type": kind, "code": code, "message": message}}
                await self.send_error("the response failed on the server" if code == "server_error" else message,
                                      code, None, client_event_id)
            item["status"] = "completed" if response["status"] == "completed" else "incomplete"
            item["content"] = [{"type": "output_audio", "transcript": text} if speaking
                               else {"type": "output_text", "text": text}]
            evicted = self._add_answer(item) if in_conversation and text else []
            if speaking and item["id"] in self.items:
                self.spoken[item["id"]] = clauses
            if last is not None:
                response["usage"] = {
                    "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
                    "input_tokens": last.num_prompt_tokens, "output_tokens": last.num_output_tokens,
                    "input_token_details": {"cached_tokens": last.num_cached_tokens,
                                            "text_tokens": last.num_prompt_tokens,
                                            "audio_tokens": _audio_tokens(heard_ms)},
                    "output_token_details": {"text_tokens": last.num_output_tokens,
                                             "audio_tokens": _audio_tokens(sum(ms for _, ms in clauses))},
                }
            if opened == 0:
                # Cancelled before it was announced (a response.cancel right behind the
                # response.create): the client still learns its id before it ends.
                await self.send({"type": "response.created", "response": {**response, "status": "in_progress",
                                                                           "status_details": None}})
            if opened == 3 and speaking:
                await self.send({"type": "response.output_audio.done", **where})
                await self.send({"type": "response.output_audio_transcript.done", **where, "transcript": text})
                await self.send({"type": "response.content_part.done", **where, "part": item["content"][0]})
            elif opened == 3:
                await self.send({"type": "response.output_text.done", **where, "text": text})
                await self.send({"type": "response.content_part.done", **where,
                                 "part": {"type": "output_text", "text": text}})
            if opened >= 2:
                response["output"] = [item]
                await self.send({"type": "response.output_item.done", "response_id": response_id,
                                 "output_index": 0, "item": item})
            if calls is not None and calls.items:
                await calls.close(response["status"] == "completed")
                response["output"] = [item] + calls.items
                if in_conversation:  # a call cut short is not part of the conversation
                    for call in calls.items:
                        if call["status"] == "completed":
                            evicted += self._add_answer(call)
            for item_id in evicted:
                await self.send({"type": "conversation.item.deleted", "item_id": item_id})
            self.announced_ids.difference_update(announced)  # joined the conversation, or never will
            await self.send({"type": "response.done", "response": response})
            # Only now: a response.create queued behind this one must not start (and announce
            # itself) before this response.done has gone out.
            self._forget_response(response_id)

    def _logprobs(self, chunk) -> list[dict]:
        entries = self.state.logprob_formatter.chat(chunk.token_ids, chunk.logprobs)["content"]
        return [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]} for e in entries]

    async def _speak(self, response_id: str, text: str, final: bool, rate: int, speed: float) -> None:
        try:
            await self.state.client.speak(response_id, text, final=final, sample_rate=rate, speed=speed)
        except EngineUnavailable as exc:  # the talker is gone or stopped reading
            raise _VoiceFailed(str(exc)) from None

    async def _pump_audio(self, speech: asyncio.Queue, where: dict, format_type: str,
                          clauses: list[tuple[str, float]]) -> str | None:
        """Sends the answer's audio as the talker makes it; returns None when it is complete,
        else why it ended (the talker died). `clauses` gets (text, ms) of each piece sent."""
        while True:
            header, pcm = await speech.get()
            if header.error is not None:
                return header.error
            if pcm:
                await self.send({"type": "response.output_audio.delta", **where,
                                 "delta": encode_client_audio(pcm, format_type)})
                clauses.append((header.text, 1000 * len(pcm) / 2 / header.sample_rate))
            if header.final:
                return None

    def _add_answer(self, item: dict) -> list[str]:
        """Append an answer to the conversation; the ids of the oldest items evicted to make room.

        The client already holds the answer's id (from response.output_item.done), so the
        answer is never the one dropped. One answer alone may exceed the byte budget.
        """
        size = _item_bytes(item)
        evicted = []
        while self.items and (len(self.items) >= self.config.max_conversation_items
                              or self.conversation_bytes + size > self.config.max_conversation_bytes):
            oldest = next(iter(self.items))
            self._forget_item(oldest)
            evicted.append(oldest)
        self.items[item["id"]] = item
        self.conversation_bytes += size
        return evicted

    # ---- sending ------------------------------------------------------------------------

    async def send(self, event: dict) -> None:
        event = {"event_id": next(self._event_ids), **event}
        async with self.send_lock:
            if self.ws.application_state != WebSocketState.CONNECTED:
                return
            try:
                await self.ws.send_text(json.dumps(event))
            except (WebSocketDisconnect, RuntimeError):
                pass  # the client is gone; the receive loop sees the disconnect

    async def send_error(self, message: str, code: str, param: str | None = None,
                         client_event_id: str | None = None) -> None:
        await self.send({"type": "error", "error": {
            "type": ("server_error" if code in ("engine_error", "engine_unavailable", "voice_unavailable", "voice_busy")
                     else "invalid_request_error"),
            "code": code, "message": message, "param": param, "event_id": client_event_id}})


class _VoiceFailed(Exception):
    """A spoken answer's audio could not be made (the talker is down or died mid-answer)."""

    def __init__(self, message: str, code: str = "voice_unavailable") -> None:
        super().__init__(message)
        self.code = code


def _settings(settings: SessionSettings, where: str) -> dict:
    """The session fields a session.update / response.create sets, under their GA names; the
    known fields it does not act on are refused when set to anything but a no-op."""
    given = {name: getattr(settings, name) for name in settings.__struct_fields__
             if getattr(settings, name) is not msgspec.UNSET}
    for name, allowed in UNSUPPORTED_SESSION_FIELDS.items():
        if given.get(name) is not None and given[name] not in allowed:
            raise InvalidInput(f"{where}.{name} is not supported by this server", "unsupported_parameter",
                               f"{where}.{name}")
    for name in ("tools", "tool_choice", "response_format"):
        if name in given:
            given[name] = msgspec.to_builtins(given[name])
    if "max_response_output_tokens" in given:  # beta name
        given.setdefault("max_output_tokens", given.pop("max_response_output_tokens"))
    if "modalities" in given:  # beta name
        given.setdefault("output_modalities", given.pop("modalities"))
    return {name: value for name, value in given.items() if name in SESSION_FIELDS}


SESSION_FIELDS = ("output_modalities", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "tools",
                  "tool_choice", "response_format", "include")


def _message_item(item: MessageItem, takes_images: bool) -> dict:
    if item.type != "message":
        return {"id": item.id or new_id("item"), "object": "realtime.item", "type": item.type, "status": "completed",
                **item.function_fields()}
    parts = item.parts()  # refuses parts of other types
    if not takes_images and any(part["type"] == "input_image" for part in parts):
        raise InvalidInput("this model takes no images", "unsupported_content_type", "item.content")
    return {"id": item.id or new_id("item"), "object": "realtime.item", "type": "message",
            "role": item.role, "status": "completed", "content": parts}


def _insert_after(items: dict[str, dict], item: dict, previous_id: str | None) -> dict[str, dict]:
    """Items in order with `item` after `previous_id` ("root": first; None: last)."""
    if previous_id is None:
        items[item["id"]] = item
        return items
    ordered = list(items.items())
    at = 0 if previous_id == "root" else next(i for i, (key, _) in enumerate(ordered) if key == previous_id) + 1
    ordered.insert(at, (item["id"], item))
    return dict(ordered)


def _previous_id(items: dict[str, dict], item_id: str) -> str | None:
    previous = None
    for key in items:
        if key == item_id:
            return previous
        previous = key
    return None


def _item_content(item: dict) -> str | list[dict]:
    """Text for the chat template, or the parts when the item holds images. Audio counts as
    its transcript: the language model hears what the recognizer heard."""
    if any(part["type"] == "input_image" for part in item["content"]):
        return [part if part["type"] == "input_image" else {"type": "input_text", "text": _part_text(part)}
                for part in item["content"]]
    return "".join(_part_text(part) for part in item["content"])


def _item_text(item: dict) -> str:
    """What of an item becomes prompt text (an image's tokens are known only once it is read)."""
    if item["type"] == "message":
        return "".join(_part_text(part) for part in item["content"] if part["type"] != "input_image")
    return "".join(item.get(name) or "" for name in ("name", "arguments", "output"))


def _least_tokens(generation, texts: list[str]) -> list[int]:
    """At least how many tokens each text takes: the floor found from its bytes where the
    tokenizer has one (engine/token_floor.py: no tokenizing), else its tokens counted."""
    if generation.floor is not None:
        return [generation.floor.tokens(text) for text in texts]
    return [len(ids) for ids in generation.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _check_call_id(item: dict, earlier: list[dict], items: list[dict], param: str = "item") -> None:
    """A function_call_output answers one function_call before it, and only once; a
    function_call's call_id is its own. `earlier`: the items before `item`; `items`: all."""
    if item["type"] == "message":
        return
    call_id = item["call_id"]
    if item["type"] == "function_call":
        if any(i["type"] == "function_call" and i["call_id"] == call_id for i in items if i is not item):
            raise InvalidInput(f"a function_call with call_id {call_id!r} already exists", "invalid_call_id",
                               f"{param}.call_id")
        return
    if not any(i["type"] == "function_call" and i["call_id"] == call_id for i in earlier):
        raise InvalidInput(f"no function_call item before this one has call_id {call_id!r}", "invalid_call_id",
                           f"{param}.call_id")
    if any(i["type"] == "function_call_output" and i["call_id"] == call_id for i in items if i is not item):
        raise InvalidInput(f"the function_call {call_id!r} already has an output", "invalid_call_id",
                           f"{param}.call_id")


def _audio_tokens(ms: float) -> int:
    """Audio in usage: one token per 100 ms. The language model itself reads the audio's
    transcript, counted in text_tokens; this meters the audio heard and spoken."""
    return math.ceil(ms / AUDIO_MS_PER_TOKEN)


def _part_text(part: dict) -> str:
    return part.get("text") or part.get("transcript") or ""


def _check_modalities(settings: dict, param: str) -> None:
    """GA sessions answer in text or in audio (with its transcript), not both at once."""
    modalities = settings.get("output_modalities")
    if modalities is not None and (len(modalities) != 1):
        raise InvalidInput('output_modalities is ["text"] or ["audio"] (audio comes with its transcript)',
                           "invalid_value", param)


def _heard_transcript(clauses: list[tuple[str, float]], end_ms: float) -> str:
    """The words of a spoken answer heard before `end_ms`: whole clauses, then the share of
    the interrupted clause's words that its audio had reached."""
    words, elapsed = [], 0.0
    for text, ms in clauses:
        if elapsed + ms <= end_ms:
            words.append(text)
        else:
            clause_words = text.split()
            share = max(0.0, end_ms - elapsed) / ms if ms else 0.0
            words.append(" ".join(clause_words[:int(len(clause_words) * share)]))
            break
        elapsed += ms
    return " ".join(w for w in words if w)




def _text_bytes(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def _item_bytes(item: dict) -> int:
    if item["type"] != "message":
        return sum(_text_bytes(item.get(name) or "") for name in ("name", "arguments", "output"))
    return sum(len(part["image_url"]) if part["type"] == "input_image" else _text_bytes(_part_text(part))
               for part in item["content"])


def _sampling(session: dict, overrides: dict, default_max_tokens: int, where: str = "session") -> SamplingParams:
    """Sampling parameters from the session's settings and a response's overrides; a bad value is
    an InvalidInput naming it under `where` (the session's own were checked when they were set)."""
    settings = {**session, **overrides}
    max_tokens = settings["max_output_tokens"]
    return sampling_params_or_invalid(
        {"temperature": settings["temperature"], "top_p": settings["top_p"], "seed": settings["seed"],
         "max_tokens": default_max_tokens if max_tokens == "inf" else max_tokens},
        {"temperature": f"{where}.temperature", "top_p": f"{where}.top_p", "seed": f"{where}.seed",
         "max_tokens": f"{where}.max_output_tokens"})
