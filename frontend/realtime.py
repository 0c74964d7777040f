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

This module keeps the socket and the wiring: it reads, decodes, orders and dispatches events,
starts and cancels responses, and sends. What the events act on lives beside it, one idea a
module: the conversation's items and what they cost (frontend/realtime_conversation.py), the
user's spoken turns (frontend/realtime_voice_turns.py), one response from response.created to
response.done (frontend/realtime_response.py), and the settings a session.update or a
response.create sets (frontend/realtime_settings.py). The turns and a response hold their
session, to send and to reach the conversation.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from frontend.admission import AdmissionRefused
from frontend.edge_decoding import InvalidInput
from frontend.limits import EventRate
from frontend.realtime_audio import merged_audio_settings
from frontend.realtime_conversation import Conversation, check_call_id, message_item, new_id
from frontend.realtime_events import (AudioAppend, AudioClear, AudioCommit, ItemCreate, ItemDelete, ItemRetrieve,
                                      ItemTruncate, ResponseCancel, ResponseCreate, SessionUpdate,
                                      decode_client_event)
from frontend.realtime_response import respond
from frontend.realtime_settings import check_answer_settings, check_modalities, new_session, sampling, settings_of
from frontend.realtime_tools import chat_tools, conversation_messages
from frontend.realtime_voice_turns import VoiceTurns, require_voice
from frontend.realtime_work import OrderedWork, off_the_socket
from frontend.tenancy import ANONYMOUS, Requester

logger = logging.getLogger("antiphon.realtime")

# Conversation events: they wait for the conversation work before them (see the docstring).
CONVERSATION_EVENTS = (ItemCreate, ItemDelete, ItemRetrieve, ItemTruncate, ResponseCreate, ResponseCancel)


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
        self.session = new_session(new_id("sess"), state.model_name)
        # An omni model speaks as one of its speakers: the first is the session's voice until the
        # client picks one (set again at the first spoken response if its talker was not ready).
        self.voice_chosen = False
        self._default_speaker()
        # The kept conversation, and the user's spoken turns that join it.
        self.history = Conversation(self.config.max_conversation_items, self.config.max_conversation_bytes,
                                    self.config.max_conversation_audio_seconds, self.config.max_audio_clips_per_request)
        self.voice = VoiceTurns(self)
        self.responses: dict[str, asyncio.Task] = {}
        # Responses sending their closing events: a cancel no longer reaches them.
        self.finishing: set[str] = set()
        self.conversation_response: str | None = None
        # Events in order, and the conversation's work in order (frontend/realtime_work.py);
        # response.create events read and not yet handled.
        self.inbox = OrderedWork()
        self.conversation = OrderedWork()
        self.creates_waiting = 0
        # Tasks of the session besides its responses and its ordered work (early transcripts).
        self.tasks: set[asyncio.Task] = set()
        self.last_activity = time.monotonic()
        self.rate = EventRate(self.config.max_events_per_second)
        self.send_lock = asyncio.Lock()
        # Event ids go out with every token: the session's random id plus a counter is as
        # unique as a fresh uuid4 per event, without a urandom call on the hot path.
        # (A prefix and a counter, not a generator over self: that would hold the session in
        # a reference cycle until the collector's full pass.)
        self._event_id_prefix = f"event_{self.session['id'][5:]}_"
        self._event_numbers = itertools.count()

    # What the conversation holds, read through the session.
    @property
    def items(self) -> dict[str, dict]:
        return self.history.items

    @property
    def conversation_bytes(self) -> int:
        return self.history.bytes

    @property
    def announced_ids(self) -> set[str]:
        return self.history.announced_ids

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
            self.voice.drop_early_transcript()
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

    def start_task(self, coroutine) -> asyncio.Task:
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
            barge_ins = self.voice.barge_ins
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
        update = settings_of(event.session, "session")
        if "audio" in update.get("output_modalities", ()):
            require_voice(self.state.engine_config, "session.output_modalities")
        check_modalities(update, "session.output_modalities")
        candidate = {**self.session, **update, "audio": merged_audio_settings(self.session["audio"], event.session)}
        if candidate["audio"]["output"]["voice"] != self.session["audio"]["output"]["voice"]:
            self._check_speaker(candidate["audio"]["output"], "session.audio.output.voice")
            self.voice_chosen = True
        sampling(candidate, {}, self.config.default_max_tokens)  # validates before anything changes
        await self._check_answer_settings(candidate, "session")
        grown = self.history.instructions_growth(self.session["instructions"], candidate["instructions"])
        if candidate["audio"]["input"]["turn_detection"] != self.session["audio"]["input"]["turn_detection"]:
            self.voice.reset_turn()  # the detector is made again with the new settings, from the next audio on
        self.session = candidate
        self.history.bytes += grown
        await self.send({"type": "session.updated", "session": self.session})

    def _default_speaker(self) -> None:
        client = self.state.client
        if client.speaks_itself and client.voices and not self.voice_chosen:
            self.session["audio"]["output"]["voice"] = client.voices[0]

    def _check_speaker(self, audio_out: dict, param: str) -> None:
        """An omni model's voices are its speakers: `audio_out`'s voice is set to the one it
        names; a voice it does not have is refused."""
        client = self.state.client
        if not client.speaks_itself or not client.voice_ready:
            # The cascade speaks every voice name with its one voice; a talker that is not
            # ready refuses the response itself.
            return
        try:
            audio_out["voice"] = client.speaker(audio_out["voice"])
        except ValueError as exc:
            raise InvalidInput(str(exc), "invalid_value", param) from None

    async def on_item_create(self, event: ItemCreate) -> None:
        item = message_item(event.item, self._takes_images)
        previous = event.previous_item_id
        self.history.check_new_item(item, previous)
        heard_ms, clips = 0.0, []
        # Recognized only once the cheap checks pass; an answer may join the conversation (and
        # evict items) while the audio is heard, so they are made again after it.
        if any(part["type"] == "input_audio" for part in item.get("content", ())):
            heard_ms, clips = await off_the_socket(self.voice.transcribe_parts(item))
            self.history.check_new_item(item, previous)
        evicted = []
        if clips:
            # Checked before anything is evicted for it; the item it goes after is never evicted.
            self.history.check_text_fits(item)
            evicted = self.history.make_room_for_clips(clips, "item.content", keep=previous)
        before = self.history.insert(item, previous, heard_ms, clips)
        for item_id in evicted:
            await self.send({"type": "conversation.item.deleted", "item_id": item_id})
        await self.send({"type": "conversation.item.added", "previous_item_id": before, "item": item})

    async def on_item_delete(self, event: ItemDelete) -> None:
        self.history.delete(event.item_id)
        await self.send({"type": "conversation.item.deleted", "item_id": event.item_id})

    async def on_item_retrieve(self, event: ItemRetrieve) -> None:
        await self.send({"type": "conversation.item.retrieved", "item": self.history.get(event.item_id)})

    async def on_item_truncate(self, event: ItemTruncate) -> None:
        self.history.truncate(event.item_id, event.content_index, event.audio_end_ms)
        await self.send({"type": "conversation.item.truncated", "item_id": event.item_id, "content_index": 0,
                         "audio_end_ms": event.audio_end_ms})

    async def on_audio_append(self, event: AudioAppend) -> None:
        await self.voice.append(event)

    async def on_audio_commit(self, event: AudioCommit) -> None:
        await self.voice.commit(event)

    async def on_audio_clear(self, event: AudioClear) -> None:
        await self.voice.clear()

    async def on_response_create(self, event: ResponseCreate, barge_ins: int | None = None) -> None:
        """Starts a response. `barge_ins`: the voice turns' barge_ins when it was asked for;
        speech that started since then cancels it as it starts (it would have been playing)."""
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
        overrides = settings_of(options, "response")
        check_modalities(overrides, "response.output_modalities")
        speaking = "audio" in overrides.get("output_modalities", session["output_modalities"])
        if speaking:
            require_voice(self.state.engine_config, "response.output_modalities")
            if not self.state.client.voice_ready:
                raise InvalidInput(f"voice is unavailable: {self.state.client.voice_status}", "voice_unavailable")
        if speaking:
            self._default_speaker()
        audio_out = merged_audio_settings(session["audio"], options)["output"] if speaking else None
        if speaking:
            self._check_speaker(audio_out, "response.audio.output.voice")
        own_input = out_of_band and options.input is not msgspec.UNSET
        if own_input:
            items = [message_item(i, self._takes_images) for i in options.input]
            for at, item in enumerate(items):
                check_call_id(item, items[:at], items, "response.input")
        else:
            items = list(self.history.items.values())
        params = sampling(session, overrides, self.config.default_max_tokens, "response")
        settings = {**session, **overrides}
        constraint = await self._check_answer_settings(settings, "response")
        if constraint is not None:
            params = msgspec.structs.replace(params, structured_output=constraint[0])
        if "response.output_text.logprobs" in (settings["include"] or ()):
            params = msgspec.structs.replace(params, logprobs=0)
        tools = chat_tools(settings["tools"]) or None
        calls_tools = tools is not None and settings["tool_choice"] != "none"
        if calls_tools and speaking and self.state.client.speaks_itself:
            # Its talker speaks every token the thinker writes: a call's JSON would be heard.
            raise InvalidInput("an omni model's spoken answer cannot call tools: ask for text "
                               "(output_modalities [\"text\"]) or set tool_choice to none", "invalid_value",
                               "response.tools")
        instructions = settings["instructions"]
        if not own_input:
            # The kept conversation costs the client nothing to send again: refuse one past the
            # prompt limit on counts kept per item, before templating it.
            await self.history.refuse_past_prompt_limit(items, instructions, self.state.generation)
        messages = ([{"role": "system", "content": instructions}] if instructions else [])
        messages += conversation_messages(items, self.history.item_content)
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
        heard_ms = sum(self.history.heard_ms.get(i["id"], 0.0) for i in items)
        metadata = None if options.metadata is msgspec.UNSET else options.metadata
        task = asyncio.create_task(respond(self, lease, prompt, params, not out_of_band, event.event_id, audio_out,
                                           heard_ms, calls_tools, metadata))
        # Bookkeeping that must happen however the task ends, even if it is cancelled
        # before it starts (a response.cancel right behind the response.create).
        lease.bind(task)
        task.add_done_callback(lambda _: self.forget_response(response_id))
        self.responses[response_id] = task
        if not out_of_band:
            self.conversation_response = response_id
        # Let the task start (and enter its try block) before the next client event is read:
        # a task cancelled before its first step would never send its response.done. (Its lease
        # does not depend on this: `bind` releases it however the task ends.)
        await asyncio.sleep(0)
        spoke_up = barge_ins is not None and barge_ins != self.voice.barge_ins
        if spoke_up and not out_of_band and response_id not in self.finishing:
            task.cancel()  # the user spoke up while it was being prepared: a barge-in as it starts

    async def _check_answer_settings(self, settings: dict, where: str) -> tuple | None:
        return await check_answer_settings(settings, where, self.state, self.requester)

    def forget_response(self, response_id: str) -> None:
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

    # ---- sending ------------------------------------------------------------------------

    async def send(self, event: dict) -> None:
        event = {"event_id": f"{self._event_id_prefix}{next(self._event_numbers)}", **event}
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
