"""Turns conversations into engine requests and engine deltas into text, for every protocol.

A request is admitted first (a `RequestLease`), then templated and tokenized off the event
loop, then streamed: each stream detokenizes incrementally, ends on a stop string, and
releases its lease (aborting the engine request) however it ends, including when the
consumer goes away (a cancelled response or a dropped connection).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from jinja2 import TemplateError

from engine import protocol
from engine.input_processor import make_engine_request
from engine.output_processor import RequestOutputProcessor
from engine.sampling_params import SamplingParams
from frontend.admission import Admission, RequestLease
from frontend.edge_decoding import InvalidInput
from frontend.engine_client import EngineClient
from frontend.metrics import Metrics


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


class GenerationService:
    def __init__(self, client: EngineClient, admission: Admission, tokenizer, eos_token_ids: list[int],
                 max_model_len: int, max_prompt_tokens: int, metrics: Metrics) -> None:
        self.client = client
        self.admission = admission
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_prompt_tokens = min(max_prompt_tokens, max_model_len - 1)
        self.metrics = metrics
        self._ids = itertools.count()
        # Templating a large conversation takes memory and a core: a few at a time.
        self._templating = asyncio.Semaphore(max(2, os.cpu_count() or 2))
        # Refuse at start, not on every request, a tokenizer incremental detokenization cannot use.
        RequestOutputProcessor(tokenizer, [], SamplingParams())

    def admit(self, request_id: str) -> RequestLease:
        """Claim a slot for a new request before any work is done for it (raises AdmissionRefused)."""
        return self.admission.admit(self.client, request_id)

    async def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Apply the chat template in a worker thread. `messages`: role and text content, already checked."""
        if not messages:
            raise InvalidInput("the conversation is empty", "empty_conversation", "messages")
        try:
            async with self._templating:
                token_ids = await anyio.to_thread.run_sync(self._apply_template, messages)
        except (TemplateError, ValueError, TypeError) as exc:
            # Templates refuse some conversations (roles that do not alternate, a system
            # message where none may go): the client's conversation, not a server fault.
            raise InvalidInput(f"the model's chat template refused this conversation: {exc}",
                               "invalid_conversation", "messages") from None
        self.check_prompt(token_ids)
        return token_ids

    def _apply_template(self, messages: list[dict]) -> list[int]:
        normalized = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
                      for m in messages]
        return list(self.tokenizer.apply_chat_template(normalized, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidInput("the prompt is empty", "empty_prompt", "messages")
        if len(token_ids) > self.max_prompt_tokens:
            raise InvalidInput(
                f"the prompt is {len(token_ids)} tokens; the limit is {self.max_prompt_tokens}",
                "prompt_too_long", "messages")

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:12]}-{next(self._ids)}"

    async def stream(self, lease: RequestLease, token_ids: list[int], params: SamplingParams,
                     cache_salt: str | None = None) -> AsyncIterator[TextChunk]:
        try:
            request = make_engine_request(lease.request_id, token_ids, params, self.eos_token_ids,
                                          self.max_model_len, cache_salt)
        except ValueError as exc:
            raise InvalidInput(str(exc), "prompt_too_long", "messages") from None
        output = RequestOutputProcessor(self.tokenizer, token_ids, request.sampling_params)
        started = time.monotonic()
        # The slot frees when the engine is done, even if this stream's reader lags behind.
        queue = await self.client.add_request(request, on_finished=lease.release)
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
                                  (delta.logprobs or [])[:len(update.token_ids)])
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

