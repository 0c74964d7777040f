"""Turns conversations into engine requests and engine deltas into text, for every protocol.

A request is admitted first (a `RequestLease`), then templated and tokenized off the event
loop (its images decoded and preprocessed in a pool of worker threads, never on the loop),
then streamed: each stream detokenizes incrementally, ends on a stop string, and
releases its lease (aborting the engine request) however it ends, including when the
consumer goes away (a cancelled response or a dropped connection).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from jinja2 import TemplateError

from engine import protocol
from engine.chat_content import split_media
from engine.chat_template import ChatTemplate, PromptTooLong
from engine.input_processor import expand_items, make_engine_request
from engine.audio_clips import audio_clip, check_audio_count
from engine.media import MediaError, MediaLimits, check_image_count, load_image
from engine.mm_inputs import PlaceholderMismatch, salt_items
from engine.output_processor import RequestOutputProcessor
from engine.request import MultiModalPlaceholder
from engine.sampling_params import SamplingParams
from frontend.admission import Admission, RequestLease
from frontend.edge_decoding import InvalidInput
from frontend.engine_client import EngineClient
from frontend.metrics import Metrics
from frontend.tool_parsers import parser_for
from frontend.tool_specs import prepare_conversation, template_supports_tools


@dataclass
class TextChunk:
    """What a stream yields: the newest text and tokens, and at the end the outcome."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list = field(default_factory=list)
    num_image_tokens: int = 0
    num_audio_tokens: int = 0


@dataclass
class ChatPrompt:
    """A templated conversation: its token ids and, with images or audio, where each item sits
    and the preprocessed items for the encoder."""

    token_ids: list[int]
    placeholders: list[MultiModalPlaceholder] = field(default_factory=list)
    items: list = field(default_factory=list)

    def item_tokens(self, modality: str) -> int:
        return sum(p.length for p in self.placeholders if p.modality == modality)


class GenerationService:
    def __init__(self, client: EngineClient, admission: Admission, tokenizer, eos_token_ids: list[int],
                 max_model_len: int, max_prompt_tokens: int, metrics: Metrics, adapter=None,
                 media_limits: MediaLimits | None = None, encoder_budget: int = 0) -> None:
        self.client = client
        self.admission = admission
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_prompt_tokens = min(max_prompt_tokens, max_model_len - 1)
        self.metrics = metrics
        # Templating a large conversation takes memory and a core: a few at a time.
        self._templating = asyncio.Semaphore(max(2, os.cpu_count() or 2))
        # Image decoding and preprocessing: the model's adapter (None: text only), the limits,
        # and a pool as wide as the machine (PIL and numpy release the GIL for the heavy parts).
        self.adapter = adapter
        self.media_limits = media_limits if media_limits is not None else MediaLimits()
        self._preprocessing = anyio.CapacityLimiter(max(1, os.cpu_count() or 1))
        self.encoder_budget = encoder_budget
        self.native_tools = template_supports_tools(getattr(tokenizer, "chat_template", None))
        # The format of tool calls, chosen once: the prompt asks for it, the grammar that
        # forces a call writes it, and the chat and Realtime handlers read it.
        self.tool_parser = parser_for()
        # Built now, not on the first request: the floor reads the whole vocabulary.
        self.template = ChatTemplate(tokenizer)
        self.floor = self.template.floor
        # Refuse at start, not on every request, a tokenizer incremental detokenization cannot use.
        RequestOutputProcessor(tokenizer, [], SamplingParams())

    def admit(self, request_id: str) -> RequestLease:
        """Claim a slot for a new request before any work is done for it (raises AdmissionRefused)."""
        return self.admission.admit(self.client, request_id)

    async def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> ChatPrompt:
        """Apply the chat template in a worker thread, and decode and preprocess the images
        in the pool. `messages`: roles and content (a string or text/image parts), already
        type-checked at the edge."""
        if not messages:
            raise InvalidInput("the conversation is empty", "empty_conversation", "messages")
        try:
            messages, images, clips = split_media(messages)
        except ValueError as exc:
            raise InvalidInput(str(exc), "invalid_content", "messages") from None
        if images and self.adapter is None:
            raise InvalidInput("this model takes no images", "unsupported_content_type", "messages")
        if clips and not self.hears_audio:
            raise InvalidInput("this model takes no audio", "unsupported_content_type", "messages")
        try:
            check_image_count(len(images), self.media_limits)
            check_audio_count(len(clips), self.media_limits)
        except MediaError as exc:
            raise InvalidInput(str(exc), exc.code, "messages") from None
        try:
            async with self._templating:
                token_ids = await anyio.to_thread.run_sync(self._apply_template, messages, tools)
        except PromptTooLong as exc:
            raise InvalidInput(str(exc), "prompt_too_long", "messages") from None
        except (TemplateError, ValueError, TypeError) as exc:
            # Templates refuse some conversations (roles that do not alternate, a system
            # message where none may go): the client's conversation, not a server fault.
            raise InvalidInput(f"the model's chat template refused this conversation: {exc}",
                               "invalid_conversation", "messages") from None
        if not images and not clips:
            self.check_prompt(token_ids)
            return ChatPrompt(token_ids)
        prompt = await self._with_media(token_ids, images, clips)
        self.check_prompt(prompt.token_ids)
        largest = max(prompt.placeholders, key=lambda p: p.length)
        if largest.length > self.encoder_budget:
            raise InvalidInput(f"an {largest.modality} item of {largest.length} embeddings is larger than the encoder "
                               f"cache budget of {self.encoder_budget} (--encoder-cache-size)",
                               f"{largest.modality}_too_large", "messages")
        return prompt

    @property
    def hears_audio(self) -> bool:
        """Whether the model itself hears audio items (an omni model); else speech is transcribed."""
        return self.adapter is not None and self.adapter.audio_token_id is not None

    async def _with_media(self, token_ids: list[int], sources: list, clips: list) -> ChatPrompt:
        # One request's media in one pool thread: requests run side by side, and a request
        # cannot take every thread of the pool.
        try:
            return await anyio.to_thread.run_sync(self._preprocess, token_ids, sources, clips,
                                                  limiter=self._preprocessing)
        except MediaError as exc:
            raise InvalidInput(str(exc), exc.code, "messages") from None
        except PlaceholderMismatch as exc:
            raise InvalidInput(str(exc), "invalid_content", "messages") from None
        except ValueError as exc:
            # Decoding and audio errors are MediaErrors: what is left is an image the model's
            # processor refused.
            raise InvalidInput(str(exc), "invalid_image", "messages") from None

    def _preprocess(self, token_ids: list[int], sources: list, clips: list) -> ChatPrompt:
        images = [load_image(source, self.media_limits) for source in sources]
        token_ids, placeholders, items = expand_items(self.adapter, token_ids, images,
                                                      [audio_clip(clip) for clip in clips])
        return ChatPrompt(token_ids, placeholders, items)

    def _apply_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        normalized = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        # Tools, tool calls and tool answers: rendered by the template when it knows them,
        # else written into the conversation in the tool parser's format (frontend/tool_specs.py).
        normalized, extra = prepare_conversation(normalized, tools, self.native_tools, self.tool_parser)
        # Refused before tokenizing when the rendered text alone is too long; client text stays text.
        return self.template.token_ids(normalized, self.max_prompt_tokens, **extra)

    def check_prompt_text(self, text: str, param: str = "prompt") -> None:
        """Refuses, before it is tokenized, a text that surely takes more tokens than a prompt may."""
        at_least = self.floor.tokens(text) if self.floor is not None else 0
        if at_least > self.max_prompt_tokens:
            raise InvalidInput(str(PromptTooLong(at_least, self.max_prompt_tokens)), "prompt_too_long", param)

    def check_prompt(self, token_ids: list[int], param: str = "messages") -> None:
        if not token_ids:
            raise InvalidInput("the prompt is empty", "empty_prompt", param)
        if len(token_ids) > self.max_prompt_tokens:
            raise InvalidInput(
                f"the prompt is {len(token_ids)} tokens; the limit is {self.max_prompt_tokens}",
                "prompt_too_long", param)

    def new_request_id(self, prefix: str = "req") -> str:
        # Random only: a counter in the id would tell every tenant how busy the server is.
        return f"{prefix}-{uuid.uuid4().hex}"

    async def stream(self, lease: RequestLease, prompt: ChatPrompt | list[int], params: SamplingParams,
                     cache_salt: str | None = None, speech: protocol.SpeechOptions | None = None,
                     conversation: str | None = None) -> AsyncIterator[TextChunk]:
        """The answer's text as the engine makes it; with `speech` an omni model also speaks it
        (its audio reaches the queue `open_speech` gave under speech.speech_id). `conversation`
        (a Realtime session) keeps its turns on one data-parallel replica."""
        if not isinstance(prompt, ChatPrompt):
            prompt = ChatPrompt(list(prompt))
        if cache_salt is not None and prompt.items:
            prompt = ChatPrompt(prompt.token_ids, *salt_items(prompt.placeholders, prompt.items, cache_salt))
        token_ids = prompt.token_ids
        try:
            request = make_engine_request(lease.request_id, token_ids, params, self.eos_token_ids,
                                          self.max_model_len, cache_salt, prompt.placeholders)
        except ValueError as exc:
            raise InvalidInput(str(exc), "prompt_too_long", "messages") from None
        request.speech = speech
        output = RequestOutputProcessor(self.tokenizer, token_ids, request.sampling_params)
        started = time.monotonic()
        # The slot frees when the engine is done, even if this stream's reader lags behind.
        queue = await self.client.add_request(request, on_finished=lease.release, items=prompt.items,
                                              conversation=conversation)
        self.metrics.request_started()
        num_output, cached, last_token_time = 0, 0, None
        finished = False
        try:
            while True:
                delta: protocol.RequestDelta = await queue.get()
                now = time.monotonic()
                if delta.new_token_ids:
                    if last_token_time is None:
                        self.metrics.observe_ttft(now - started)
                    else:
                        self.metrics.observe_itl(now - last_token_time)
                    last_token_time = now
                update = output.update(delta.new_token_ids, delta.finish_reason, delta.stop_reason)
                num_output += len(update.token_ids)
                cached = delta.num_cached_tokens
                finished, finish = update.finished, update.finish_reason
                chunk = TextChunk(update.text, update.token_ids, finish, update.stop_reason, delta.error,
                                  len(token_ids), num_output, cached,
                                  (delta.logprobs or [])[:len(update.token_ids)], prompt.item_tokens("image"),
                                  prompt.item_tokens("audio"))
                if finished:
                    self.metrics.request_finished(finish, len(token_ids), num_output, cached)
                    # Before the last yield: a stop string ends the engine request now, not
                    # when the consumer next pulls.
                    lease.release()
                    yield chunk
                    return
                if chunk.text or chunk.token_ids:
                    yield chunk
        finally:
            if not finished:
                # The consumer stopped early (cancel, disconnect).
                self.metrics.request_finished("abort", len(token_ids), num_output, cached)
            # Aborts the engine request (freeing its KV blocks) unless it finished there.
            lease.release()

