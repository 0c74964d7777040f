"""POST /v1/chat/completions: plain and SSE, n choices, logprobs, structured output, tools,
and spoken answers.

A request runs through frontend/request_lifecycle.py (its body, admission, cache salt, a
client that leaves, the streaming hand-off, the release); this module keeps what is chat's
own: the body decoded into a typed struct (unknown fields refused), checked (its grammar
compiled off the loop, its spoken parts transcribed) before its choices are admitted, the
conversation templated, and the answer written as chat completion chunks or one message.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.chat_audio import SPEECH_RATE, SpeechFailed, SpokenAnswer, prepare_audio_parts
from frontend.chat_request import ChatCompletionRequest
from frontend.choices import Choice, merged, params_per_choice
from frontend.edge_decoding import InvalidInput
from frontend.engine_errors import EngineUnavailable
from frontend.generation import TextChunk
from frontend.openai_http import sse_data, usage_of
from frontend.request_fields import decode_request
from frontend.request_lifecycle import RequestLifecycle, answer_request
from frontend.structured_output import (check_logit_bias, forced_call_grammar, named_choice)
from frontend.tenancy import Requester
from frontend.tool_parsers import ToolCallDelta, tool_calls_json
from frontend.tool_specs import ToolSpecError, validate_tools


@dataclass
class ChatPlan:
    """What a checked request asks for, beyond its sampling parameters."""

    body: ChatCompletionRequest
    params: object
    messages: list
    n: int
    tools: list | None
    spoken_format: str | None
    # The omni model's speaker for a spoken answer (None with the cascade's one voice).
    speaker: str | None = None


class ChatCompletions:
    def __init__(self, app_state) -> None:
        self.state = app_state

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.state.model_name, "object": "model", "created": self.state.started, "owned_by": "antiphon"}]})

    async def create(self, request: Request) -> Response:
        return await answer_request(request, self.state.config, self.state.generation, self._answer)

    async def _answer(self, lifecycle: RequestLifecycle, body_bytes: bytes) -> Response:
        state = self.state
        # Checked while the client listens: its grammar compile and transcriptions stop if it leaves.
        plan = await lifecycle.while_connected(self._plan(body_bytes, lifecycle.requester))
        request_id = lifecycle.admit("chatcmpl", plan.n)
        spoken = None
        if plan.spoken_format is not None:
            spoken = SpokenAnswer(state.client, request_id, plan.spoken_format, state.spoken_answers,
                                  lifecycle.requester)
            lifecycle.on_release(spoken.close)
        prompt = await lifecycle.while_connected(state.generation.chat_prompt(plan.messages, plan.tools))
        speech = None
        if spoken is not None and plan.speaker is not None:
            speech = state.client.speech_options(request_id, plan.speaker, SPEECH_RATE, plan.params.seed)
        choices = await lifecycle.start([prompt] * plan.n, params_per_choice(plan.params, plan.n), speech)
        if plan.body.stream:
            return lifecycle.stream(self._sse(request_id, choices, plan, spoken))
        return await self._complete(lifecycle, request_id, choices, plan, spoken)

    async def _plan(self, body_bytes: bytes, requester: Requester) -> ChatPlan:
        state, config = self.state, self.state.config
        body = decode_request(body_bytes, ChatCompletionRequest, config.accept_unknown_fields)
        # What costs nothing to count is counted before any work (the prompt's own length is
        # bounded before it is tokenized: GenerationService.chat_prompt).
        if len(body.messages) > config.max_messages:
            raise InvalidInput(f"at most {config.max_messages} messages (--max-messages)", "invalid_value", "messages")
        body.check_supported()
        params = body.sampling_params(config.default_max_tokens, config.max_stop_strings, config.max_logprobs,
                                      config.max_choices)
        n = body.n or 1
        check_logit_bias(params, state.client.ready["decoder"].vocab_size)
        tools = self._tools(body)
        constraint = body.constraint(config.max_grammar_bytes)
        grammar = await forced_call_grammar(tools, body.tool_choice, body.parallel_tool_calls,
                                            config.max_grammar_bytes, state.generation.tool_parser) if tools else None
        if grammar is not None:
            if constraint is not None:
                raise InvalidInput(f"{constraint[1]} cannot be combined with a tool_choice that forces a tool call",
                                   "invalid_value", constraint[1])
            constraint = (grammar, "tool_choice")
        if constraint is not None:
            await state.grammar_checker.check(*constraint, requester)
            params = msgspec.structs.replace(params, structured_output=constraint[0])
        body.recall_spoken_answers(state.spoken_answers, requester.tenant)
        messages = body.conversation()
        spoken_format, speaker = body.spoken_format(), None
        if spoken_format is not None:
            if not state.engine_config.voice:
                raise InvalidInput("voice is off on this server (--no-voice)", "unsupported_modality", "modalities")
            if body.stream and spoken_format == "wav":
                raise InvalidInput("streamed audio is pcm16: set audio.format to pcm16", "invalid_value",
                                   "audio.format")
            if n > 1 or tools:
                raise InvalidInput("a spoken answer is one choice without tools", "invalid_value",
                                   "n" if n > 1 else "tools")
            if state.client.speaks_itself:
                if not state.client.voice_ready:
                    # Refused now: an answer planned without its speaker would never be spoken.
                    raise EngineUnavailable(f"voice unavailable: {state.client.voice_status}")
                try:
                    speaker = state.client.speaker(body.audio.voice)
                except ValueError as exc:
                    raise InvalidInput(str(exc), "invalid_value", "audio.voice") from None
        # Spoken parts become encoder items an omni model hears, or their transcripts.
        await prepare_audio_parts(state.client, messages, state.generation.hears_audio, state.engine_config.voice,
                                  config.max_audio_buffer_seconds, requester)
        return ChatPlan(body, params, messages, n, tools, spoken_format, speaker)

    def _tools(self, body: ChatCompletionRequest) -> list[dict] | None:
        """The request's tools as dicts, checked; None when there are none or none may be called."""
        if body.tools is None and body.tool_choice in (None, "none", "auto"):
            return None
        tools = [msgspec.to_builtins(tool) for tool in body.tools or []]
        if len(tools) > self.state.config.max_tools:
            raise InvalidInput(f"at most {self.state.config.max_tools} tools (--max-tools)", "invalid_value", "tools")
        try:
            validate_tools(tools, named_choice(body.tool_choice))
        except ToolSpecError as exc:
            raise InvalidInput(str(exc), "invalid_value", exc.param) from None
        # tool_choice "none": the model sees the tools but may not call them.
        return tools or None

    def _calls_tools(self, plan: ChatPlan) -> bool:
        return plan.tools is not None and plan.body.tool_choice != "none"

    async def _complete(self, lifecycle: RequestLifecycle, request_id: str, choices: list[Choice], plan: ChatPlan,
                        spoken: SpokenAnswer | None) -> Response:
        """The whole answer; if the client goes away meanwhile, generation stops at once."""
        all_chunks = await lifecycle.all_chunks(choices)
        out = [self._choice(index, chunks, plan) for index, chunks in enumerate(all_chunks)]
        if spoken is not None:
            text = out[0]["message"]["content"]
            await spoken.say(text, final=True)
            pcm = await lifecycle.while_connected(spoken.rest())
            # As OpenAI's audio answers: the text is the audio's transcript.
            out[0]["message"] = {"role": "assistant", "content": None,
                                 "audio": spoken.message_audio(b"".join(pcm), text)}
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.state.model_name, "choices": out, "usage": usage_of([c[-1] for c in all_chunks]),
        })

    def _choice(self, index: int, chunks: list[TextChunk], plan: ChatPlan) -> dict:
        text = "".join(c.text for c in chunks)
        finish_reason = chunks[-1].finish_reason
        message = {"role": "assistant", "content": text}
        if self._calls_tools(plan):
            content, calls = self.state.generation.tool_parser.parse(text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": tool_calls_json(calls)}
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choice = {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": None}
        token_ids = [t for c in chunks for t in c.token_ids]
        if plan.params.logprobs is not None:
            choice["logprobs"] = self.state.logprob_formatter.chat(token_ids, [lp for c in chunks for lp in c.logprobs])
        if plan.body.return_token_ids:  # extension, as in vLLM
            choice["token_ids"] = token_ids
        return choice

    async def _sse(self, request_id: str, choices: list[Choice], plan: ChatPlan, spoken: SpokenAnswer | None):
        created = int(time.time())
        body = plan.body
        include_usage = body.include_usage
        parser = self.state.generation.tool_parser
        parsers = {c.index: parser.streaming() for c in choices} if self._calls_tools(plan) else {}
        called = set()
        last_chunks: dict[int, TextChunk] = {}

        def event(index: int, delta: dict, finish_reason=None, logprobs=None) -> str:
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
            if logprobs is not None:
                choice["logprobs"] = logprobs
            return sse_data({"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": self.state.model_name, "choices": [choice]})

        stream = merged(choices)
        try:
            # The role events go out in the same write as the first tokens, not one write ahead.
            out = [event(c.index, {"role": "assistant", "content": ""}) for c in choices]
            async for index, chunk in stream:
                if chunk.finish_reason == "error":
                    out.append(sse_data({"error": {"message": chunk.error, "type": "server_error",
                                                   "code": "engine_error"}}))
                    break
                logprobs = (self.state.logprob_formatter.chat(chunk.token_ids, chunk.logprobs)
                            if plan.params.logprobs is not None and chunk.token_ids else None)
                if spoken is not None:
                    failed = await self._spoken_events(spoken, chunk, event, out)
                    if failed:
                        break
                    if chunk.finish_reason is not None:
                        talker_failed: list[str] = []
                        async for pieces in self._rest_of_speech(spoken, event, talker_failed):
                            yield "".join(out)
                            out = pieces
                        if talker_failed:
                            break
                elif index in parsers:
                    pieces = parsers[index].feed(chunk.text)
                    if chunk.finish_reason is not None:
                        pieces += parsers[index].finish()
                    out += self._tool_events(index, pieces, event, logprobs, called)
                elif chunk.text or logprobs is not None or (body.return_token_ids and chunk.token_ids):
                    delta = {"content": chunk.text}
                    if body.return_token_ids:
                        delta["token_ids"] = chunk.token_ids
                    out.append(event(index, delta, logprobs=logprobs))
                if chunk.finish_reason is not None:
                    last_chunks[index] = chunk
                    reason = "tool_calls" if index in called and chunk.finish_reason == "stop" else chunk.finish_reason
                    out.append(event(index, {}, reason))
                    if len(last_chunks) == len(choices) and include_usage:
                        out.append(sse_data({"id": request_id, "object": "chat.completion.chunk", "created": created,
                                             "model": self.state.model_name, "choices": [],
                                             "usage": usage_of([last_chunks[i] for i in sorted(last_chunks)])}))
                if out and len(last_chunks) < len(choices):
                    yield "".join(out)
                    out = []
            out.append("data: [DONE]\n\n")
            yield "".join(out)
        finally:
            # Runs on normal end and when the client disconnects; closing the merged stream
            # closes every choice, whose cleanup releases its lease.
            if spoken is not None:
                spoken.close()
            await stream.aclose()

    @staticmethod
    def _tool_events(index: int, pieces: list, event, logprobs, called: set) -> list[str]:
        out = []
        for piece in pieces:
            if isinstance(piece, ToolCallDelta):
                called.add(index)
                call = {"index": piece.index, "function": {"arguments": piece.arguments}}
                if piece.id is not None:
                    call.update(id=piece.id, type="function")
                    call["function"] = {"name": piece.name, "arguments": piece.arguments}
                out.append(event(index, {"tool_calls": [call]}, logprobs=logprobs))
            elif piece:
                out.append(event(index, {"content": piece}, logprobs=logprobs))
            else:
                continue
            logprobs = None  # once per chunk, with its first event
        if logprobs is not None:
            out.append(event(index, {}, logprobs=logprobs))
        return out

    @staticmethod
    async def _spoken_events(spoken: SpokenAnswer, chunk: TextChunk, event, out: list) -> bool:
        """A spoken answer's events for one chunk: its text is the audio's transcript, and the
        audio follows as it is made. True when the talker failed (an error event is added)."""
        try:
            if chunk.text:
                out.append(event(0, {"audio": {"id": spoken.id, "transcript": chunk.text}}))
                await spoken.say(chunk.text)
            out += [event(0, {"audio": {"id": spoken.id, "data": base64.b64encode(pcm).decode()}})
                    for pcm in spoken.ready()]
            if chunk.finish_reason is not None:
                await spoken.say("", final=True)
            return False
        except (SpeechFailed, EngineUnavailable) as exc:
            out.append(sse_data({"error": {"message": str(exc), "type": "server_error", "code": "voice_unavailable"}}))
            return True

    @staticmethod
    async def _rest_of_speech(spoken: SpokenAnswer, event, failed: list[str]):
        """After the text: the rest of the audio, each piece as soon as it is made (a talker
        failure: an error event, and `failed` gets its message)."""
        while not spoken.ended:
            try:
                pieces = await spoken.next_pieces()
            except (SpeechFailed, EngineUnavailable) as exc:
                failed.append(str(exc))
                yield [sse_data({"error": {"message": str(exc), "type": "server_error", "code": "voice_unavailable"}})]
                return
            yield [event(0, {"audio": {"id": spoken.id, "data": base64.b64encode(pcm).decode()}}) for pcm in pieces]
