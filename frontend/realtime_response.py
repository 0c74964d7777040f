"""One response of a Realtime session, from response.created to response.done.

A `Response` runs in a task of its own, in phases: it opens its speech (a spoken answer) and
its engine request; announces itself (response.created, response.output_item.added,
response.content_part.added); streams its answer (text deltas, or the transcript and the
audio of a spoken answer, and function calls as items of their own); and always closes:
it frees its engine request and speech, records its answer in the conversation and sends the
closing events that match the opening events that went out, then response.done.

A cancel (response.cancel, a barge-in, the client leaving) may land anywhere before the
closing phase; once that phase starts, the session's cancels leave the response alone, so
its closing events always go out and its answer joins the conversation.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from frontend.admission import RequestLease
from frontend.engine_errors import EngineUnavailable, VoiceBusy
from frontend.realtime_audio import encode_client_audio
from frontend.realtime_conversation import new_id
from frontend.realtime_tools import FunctionCallStream

if TYPE_CHECKING:
    from frontend.realtime import RealtimeSession

logger = logging.getLogger("antiphon.realtime")

AUDIO_MS_PER_TOKEN = 100


async def respond(session: RealtimeSession, lease: RequestLease, prompt: list[int], params: SamplingParams,
                  in_conversation: bool, client_event_id: str | None, audio_out: dict | None = None,
                  heard_ms: float = 0.0, calls_tools: bool = False, metadata: dict | None = None) -> None:
    """Runs one response to its response.done. The response is made inside its task: one
    cancelled before it starts announces no item ids."""
    await Response(session, lease, prompt, params, in_conversation, client_event_id, audio_out, heard_ms,
                   calls_tools, metadata).run()


class Response:
    def __init__(self, session: RealtimeSession, lease: RequestLease, prompt: list[int], params: SamplingParams,
                 in_conversation: bool, client_event_id: str | None, audio_out: dict | None, heard_ms: float,
                 calls_tools: bool, metadata: dict | None) -> None:
        self.session = session
        self.state = session.state
        self.lease, self.prompt, self.params = lease, prompt, params
        self.in_conversation = in_conversation
        self.client_event_id = client_event_id
        self.audio_out = audio_out
        self.heard_ms = heard_ms
        self.id = lease.request_id
        # The ids of the output items, announced before they join the conversation (at the end).
        self.announced: list[str] = []
        # Function calls the answer makes become output items of their own, after the message.
        self.calls = (FunctionCallStream(session.send, self.id, self._announce_id, self.state.generation.tool_parser)
                      if calls_tools else None)
        # A spoken answer: its text goes to the talker as it comes and out as the audio's
        # transcript; its audio is pumped to the client by a task of its own.
        self.speaking = audio_out is not None
        self._speaks_itself = self.speaking and self.state.client.speaks_itself
        self._spoken_upto = 0  # of self.text, attributed to audio sent (omni)
        if self.speaking:
            self.rate, self.speed = audio_out["format"]["rate"], audio_out["speed"]
        self.item = {"id": self._announce_id(), "object": "realtime.item", "type": "message", "role": "assistant",
                     "status": "in_progress", "content": []}
        # The response object the client sees. `metadata` is the response.create's, echoed: a
        # client tells its own responses from those server VAD starts by it.
        self.response = {"id": self.id, "object": "realtime.response", "status": "in_progress",
                         "status_details": None, "output": [],
                         "output_modalities": ["audio" if self.speaking else "text"], "usage": None,
                         "metadata": metadata,
                         "conversation_id": session.session["id"] if in_conversation else None}
        self.where = {"response_id": self.id, "item_id": self.item["id"], "output_index": 0, "content_index": 0}
        # How many opening events went out: a cancel may land between any two of them (an
        # event whose send is cancelled was not written), and the closing events match them.
        self.opened = 0
        self.text, self.last, self.error = "", None, None
        self.clauses: list[tuple[str, float]] = []
        self.pump: asyncio.Task | None = None

    def _announce_id(self) -> str:
        self.announced.append(new_id("item"))
        self.session.history.announced_ids.add(self.announced[-1])
        return self.announced[-1]

    async def run(self) -> None:
        self._open_speech()
        speech = self._speech_options()
        stream = self.state.generation.stream(self.lease, self.prompt, self.params, self.session.cache_salt, speech,
                                              conversation=self.session.session["id"])
        # Submit the engine request first and announce the response while the prefill runs:
        # the opening events are not on the way to the first token. Sending them does not
        # yield to the loop, so without this sleep(0) the task would submit only after all
        # three (measured: 0.5 ms of TTFT).
        first = asyncio.create_task(anext(stream, None))
        try:
            await asyncio.sleep(0)
            await self._announce()
            if self.speaking and self.pump is None:
                raise _VoiceFailed(self.error[2], self.error[1])
            await self._stream(first, stream)
            if self.speaking:
                await self._finish_speaking(stream)
            self._settle()
        except EngineUnavailable as exc:
            self.error = ("server_error", "engine_unavailable", str(exc))
        except _VoiceFailed as exc:
            self.error = ("server_error", exc.code, str(exc))
        except asyncio.CancelledError:
            self.response["status"] = "cancelled"
            self.response["status_details"] = {"type": "cancelled", "reason": "client_cancelled"}
        except Exception as exc:
            # Never leave a response in_progress: whatever broke, the client hears of it.
            logger.exception("response %s failed", self.id)
            self.error = ("server_error", "server_error", str(exc))
        finally:
            # From here on a response.cancel leaves this response alone: nothing may cut the
            # closing events below (set before the first await, so no cancel slips in).
            self.session.finishing.add(self.id)
            await self._release(first, stream)
            await self._close()

    # ---- opening ------------------------------------------------------------------------

    def _open_speech(self) -> None:
        """Opens the talker's stream for a spoken answer; a talker that refuses is the
        response's error, raised once the response is announced."""
        if not self.speaking:
            return
        try:
            speech = self.state.client.open_speech(self.id, requester=self.session.requester)
        except EngineUnavailable as exc:
            code = "voice_busy" if isinstance(exc, VoiceBusy) else "voice_unavailable"
            speech, self.error = None, ("server_error", code, str(exc))
        if speech is not None:
            self.pump = asyncio.create_task(self._pump_audio(speech, self.audio_out["format"]["type"]))

    def _speech_options(self):
        """What the engine request of an omni model's spoken answer carries (None otherwise); a
        voice the talker no longer has is the response's error, as a talker that refuses."""
        if not self.speaking or self.pump is None:
            return None
        try:
            return self.state.client.speech_options(self.id, self.audio_out["voice"], self.rate, self.params.seed)
        except ValueError as exc:
            self.pump.cancel()
            self.pump, self.error = None, ("server_error", "voice_unavailable", str(exc))
            return None

    async def _announce(self) -> None:
        part = {"type": "output_audio", "transcript": ""} if self.speaking else {"type": "output_text", "text": ""}
        opening = [{"type": "response.created", "response": self.response},
                   {"type": "response.output_item.added", "response_id": self.id, "output_index": 0,
                    "item": self.item},
                   {"type": "response.content_part.added", **self.where, "part": part}]
        for event in opening:
            await self.session.send(event)
            self.opened += 1

    # ---- streaming ----------------------------------------------------------------------

    async def _stream(self, first: asyncio.Task, stream) -> None:
        """The answer's text as the engine makes it: said (text or transcript and speech), or
        a function call's."""
        send = self.session.send
        chunk = await first
        while chunk is not None:
            self.last = chunk
            said = chunk.text
            if self.calls is not None:
                said = await self.calls.feed(chunk.text, final=chunk.finish_reason is not None)
            if said:
                self.text += said
                if self.speaking:
                    if self.pump.done() and (self.pump.result() is not None or not self._speaks_itself):
                        # The talker failed: the answer cannot be spoken. (An omni model's
                        # talker may end its speech before the text ends: the text goes on.)
                        raise _VoiceFailed(self.pump.result() or "speech ended early")
                    await send({"type": "response.output_audio_transcript.delta", **self.where, "delta": said})
                    await self._speak(said, False)
            # Logprobs go with text that is shown as it is (not a tool call's, not held back).
            with_logprobs = self.params.logprobs is not None and chunk.token_ids and said == chunk.text
            if not self.speaking and (said or with_logprobs):
                delta = {"type": "response.output_text.delta", **self.where, "delta": said}
                if with_logprobs:
                    delta["logprobs"] = self._logprobs(chunk)
                await send(delta)
            chunk = await anext(stream, None)

    async def _finish_speaking(self, stream) -> None:
        await self._speak("", True)
        # The decoder is done: its admission slot is free while the audio plays out.
        await stream.aclose()
        self.lease.release()
        failure = await self.pump  # every clause sent: the answer is complete when its audio is
        if failure is not None:
            raise _VoiceFailed(failure)

    def _settle(self) -> None:
        """The response's status, from how its stream ended."""
        last = self.last
        self.response["status"] = {"stop": "completed", "length": "incomplete"}.get(last.finish_reason, "failed")
        if last.finish_reason == "length":
            self.response["status_details"] = {"type": "incomplete", "reason": "max_output_tokens"}
        elif self.response["status"] == "failed":
            self.error = ("server_error", "engine_error", last.error or "generation failed")

    def _logprobs(self, chunk) -> list[dict]:
        entries = self.state.logprob_formatter.chat(chunk.token_ids, chunk.logprobs)["content"]
        return [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]} for e in entries]

    async def _speak(self, text: str, final: bool) -> None:
        try:
            await self.state.client.speak(self.id, text, final=final, sample_rate=self.rate, speed=self.speed)
        except EngineUnavailable as exc:  # the talker is gone or stopped reading
            raise _VoiceFailed(str(exc)) from None

    async def _pump_audio(self, speech: asyncio.Queue, format_type: str) -> str | None:
        """Sends the answer's audio as the talker makes it; returns None when it is complete,
        else why it ended (the talker died). self.clauses gets (text, ms) of each piece sent."""
        while True:
            header, pcm = await speech.get()
            if header.error is not None:
                return header.error
            if pcm:
                await self.session.send({"type": "response.output_audio.delta", **self.where,
                                         "delta": encode_client_audio(pcm, format_type)})
                text = header.text
                if self._speaks_itself:
                    # An omni talker's audio carries no text: it speaks what the thinker wrote
                    # up to now (a little ahead of the audio: the talker lags the thinker).
                    text, self._spoken_upto = self.text[self._spoken_upto:], len(self.text)
                self.clauses.append((text, 1000 * len(pcm) / 2 / header.sample_rate))
            if header.final:
                return None

    # ---- closing ------------------------------------------------------------------------

    async def _release(self, first: asyncio.Task, stream) -> None:
        """Frees the engine request, the admission slot and the speech, however the response ended."""
        if first.done():
            if not first.cancelled():
                first.exception()  # seen, so asyncio does not log it as never retrieved
        else:
            # Cancelled before the first chunk: stop the pending step, whose cleanup aborts
            # the engine request.
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()  # a no-op if the stream already ended
        self.lease.release()
        if self.speaking:
            self.state.client.cancel_speech(self.id)  # a no-op once its audio is complete
            if self.pump is not None and not self.pump.done():
                self.pump.cancel()
                await asyncio.gather(self.pump, return_exceptions=True)

    async def _close(self) -> None:
        """The closing events, matching the opening events that went out; the answer joins
        the conversation (evicting the oldest items if it must) before response.done."""
        session, response, item = self.session, self.response, self.item
        if self.error is not None:
            kind, code, message = self.error
            response["status"] = "failed"
            response["status_details"] = {"type": "failed", "error": {"type": kind, "code": code, "message": message}}
            await session.send_error("the response failed on the server" if code == "server_error" else message,
                                     code, None, self.client_event_id)
        evicted = self._record_answer()
        await self._close_opened()
        if self.calls is not None and self.calls.items:
            await self.calls.close(response["status"] == "completed")
            response["output"] = [item] + self.calls.items
            if self.in_conversation:  # a call cut short is not part of the conversation
                for call in self.calls.items:
                    if call["status"] == "completed":
                        evicted += session.history.add_answer(call)
        for item_id in evicted:
            await session.send({"type": "conversation.item.deleted", "item_id": item_id})
        session.history.announced_ids.difference_update(self.announced)  # joined the conversation, or never will
        await session.send({"type": "response.done", "response": response})
        # Only now: a response.create queued behind this one must not start (and announce
        # itself) before this response.done has gone out.
        session.forget_response(self.id)

    def _record_answer(self) -> list[str]:
        """The answer's item as it ended, in the conversation if it belongs there, and the
        response's usage; the ids of the items evicted for it."""
        history, item, last = self.session.history, self.item, self.last
        item["status"] = "completed" if self.response["status"] == "completed" else "incomplete"
        item["content"] = [{"type": "output_audio", "transcript": self.text} if self.speaking
                           else {"type": "output_text", "text": self.text}]
        evicted = history.add_answer(item) if self.in_conversation and self.text else []
        if self.speaking and item["id"] in history.items:
            history.spoken[item["id"]] = self.clauses
        if last is not None:
            self.response["usage"] = {
                "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
                "input_tokens": last.num_prompt_tokens, "output_tokens": last.num_output_tokens,
                "input_token_details": {"cached_tokens": last.num_cached_tokens,
                                        "text_tokens": last.num_prompt_tokens,
                                        "audio_tokens": _audio_tokens(self.heard_ms)},
                "output_token_details": {"text_tokens": last.num_output_tokens,
                                         "audio_tokens": _audio_tokens(sum(ms for _, ms in self.clauses))},
            }
        return evicted

    async def _close_opened(self) -> None:
        send, response, item, where = self.session.send, self.response, self.item, self.where
        if self.opened == 0:
            # Cancelled before it was announced (a response.cancel right behind the
            # response.create): the client still learns its id before it ends.
            await send({"type": "response.created", "response": {**response, "status": "in_progress",
                                                                   "status_details": None}})
        if self.opened == 3 and self.speaking:
            await send({"type": "response.output_audio.done", **where})
            await send({"type": "response.output_audio_transcript.done", **where, "transcript": self.text})
            await send({"type": "response.content_part.done", **where, "part": item["content"][0]})
        elif self.opened == 3:
            await send({"type": "response.output_text.done", **where, "text": self.text})
            await send({"type": "response.content_part.done", **where,
                        "part": {"type": "output_text", "text": self.text}})
        if self.opened >= 2:
            response["output"] = [item]
            await send({"type": "response.output_item.done", "response_id": self.id, "output_index": 0,
                        "item": item})


class _VoiceFailed(Exception):
    """A spoken answer's audio could not be made (the talker is down or died mid-answer)."""

    def __init__(self, message: str, code: str = "voice_unavailable") -> None:
        super().__init__(message)
        self.code = code


def _audio_tokens(ms: float) -> int:
    """Audio in usage: one token per 100 ms. The language model itself reads the audio's
    transcript, counted in text_tokens; this meters the audio heard and spoken."""
    return math.ceil(ms / AUDIO_MS_PER_TOKEN)
