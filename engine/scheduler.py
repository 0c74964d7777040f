"""The scheduler: one token budget per step, decodes first, then prefill chunks.

There is no prefill/decode phase split: each request just advances num_computed_tokens
towards num_tokens. It advances when scheduled, not when the step returns, and a request
whose chunk reaches its last known token gets an output placeholder: so the next step can
be scheduled while this one still runs (asynchronous scheduling), the runner filling in the
token it sampled. When the KV pool runs dry the newest running request is preempted
(its blocks freed, recomputed later), so the oldest always makes progress.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from engine.block_hash import extend_block_hashes
from engine.config import EngineConfig
from engine.embedding_tracker import EmbeddingTracker
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler_output import (ModelRunnerOutput, NewRequestData,
                                     SchedulerOutput, TokenLogprobs)

logger = logging.getLogger("antiphon")


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, max_model_len: int,
                 encoder_budget: int = 0) -> None:
        self.config = config
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Runner-side state to drop at the next step.
        self.finished_ids: set[str] = set()
        # Requests the runner already holds (sent once as NewRequestData).
        self.known_to_runner: set[str] = set()
        self.stalled_steps = 0
        self.num_preemptions = 0
        # Finished-by-the-scheduler outputs not yet reported (errors found while scheduling).
        self.pending_outputs: list[EngineCoreOutput] = []
        self.num_image_tokens_in = 0
        self.embeddings = EmbeddingTracker(encoder_budget, config.encoder_timeout_s)

    # ---- admission -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        if request.mm_placeholders:
            self.num_image_tokens_in += sum(p.length for p in request.mm_placeholders if p.modality == "image")
        extend_block_hashes(request, self.block_size)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def set_input_limit(self, request_id: str, limit: int | None) -> None:
        """More of a request's inputs exist (None: all of them, for ever)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.input_limit = limit

    def check_request(self, request: Request) -> None:
        """Raises ValueError if the request could never run here; changes nothing."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt is {request.num_prompt_tokens} tokens; the context is {self.max_model_len} "
                f"tokens and at least one must be left for output")
        needed = self.kv.blocks_needed(request.num_prompt_tokens + 1)
        if needed > self.kv.pool.num_usable_blocks:
            raise ValueError(
                f"prompt needs {needed} KV blocks but the pool holds {self.kv.pool.num_usable_blocks}")
        if request.mm_placeholders:
            if not self.embeddings.budget:
                raise ValueError("this model takes no images or audio")
            self.embeddings.check_fits(request)

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        doomed = [request for request in map(self.requests.get, request_ids)
                  if request is not None and not request.status.finished]
        # Thousands may wait: take the aborted ones out of the queue in one pass, not one
        # scan per request.
        queued = {r.request_id for r in doomed if r.status is not RequestStatus.RUNNING}
        if queued:
            self.waiting = deque(r for r in self.waiting if r.request_id not in queued)
        for request in doomed:
            self._finish(request, status, dequeued=request.request_id in queued)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- multimodal inputs ------------------------------------------------------------

    def plan_encoder_inputs(self) -> list[str]:
        """Claim the embeddings that running and waiting requests will need, in that order,
        and return the item hashes to ask the encoder for. Runs before `schedule`, so an
        encoder in this process can deliver them for the same step, and one in another
        process starts on them while the text before them prefills."""
        tracker = self.embeddings
        if not tracker.budget:
            return []
        for mm_hash in tracker.overdue():
            self._fail_users(mm_hash, f"the encoder did not deliver an item within "
                                      f"{self.config.encoder_timeout_s:g} s (encoder_timeout_s)")
        waiting = [r for r in self.waiting if r.mm_placeholders and not r.num_output_placeholders]
        newest_first = waiting[::-1]
        for request in self.running:
            if request.mm_placeholders:
                tracker.claim(request, request.num_computed_tokens, newest_first)
        for position, request in enumerate(waiting):
            computed = request.num_computed_tokens
            if tracker.holds_all(request, computed):
                continue
            if computed == 0:
                # Items a prefix hit covers are never encoded for this request.
                computed = len(self.kv.find_cached_prefix(request)) * self.block_size
            # The first image request in the queue is served next: it may take room held
            # for those behind it.
            if not tracker.claim(request, computed, newest_first if position == 0 else ()):
                break
        requested, tracker.to_request = tracker.to_request, []
        return requested

    def on_embeddings(self, mm_hash: str, embeddings=None, error: str | None = None) -> None:
        """The encoder delivered an item (or failed it: every request needing it fails)."""
        if error is not None:
            self._fail_users(mm_hash, f"encoding failed: {error}")
        elif not self.embeddings.on_arrival(mm_hash, embeddings):
            self._fail_users(mm_hash, f"the encoder delivered embeddings of shape "
                                      f"{tuple(getattr(embeddings, 'shape', ()))} for an item of another length")

    def fail_items_in_flight(self, message: str) -> None:
        """The encoder asked for these items is gone: their requests fail now rather than at
        the timeout, and a later request with the same item asks its successor afresh."""
        for mm_hash in [h for h, entry in self.embeddings.entries.items() if not entry.available]:
            self._fail_users(mm_hash, message)

    def _fail_users(self, mm_hash: str, message: str) -> None:
        for request_id in self.embeddings.users_of(mm_hash):
            request = self.requests.get(request_id)
            if request is not None and not request.status.finished:
                self._fail(request, message)

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self.finished_ids,
                              new_embeddings=self.embeddings.take_arrived())
        self.finished_ids = set()
        budget = self.config.max_num_batched_tokens
        preempted = False

        # Running requests first: decodes, and prefills that already hold blocks.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                          budget)
            if request.mm_placeholders and num_new > 0:
                num_new = self.embeddings.schedulable(request, request.num_computed_tokens, num_new)
            if request.input_limit is not None:
                num_new = min(num_new, request.input_limit - request.num_computed_tokens)
            if num_new <= 0 or self._will_have_finished(request):
                index += 1
                continue
            new_blocks = self.kv.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, num_new)
            else:
                out.cached_requests.append(request.request_id, [b.block_id for b in new_blocks],
                                           request.num_computed_tokens)
                out.num_scheduled_tokens[request.request_id] = num_new
                self._advance(request, num_new)
                budget -= num_new
                index += 1
                if request.mm_placeholders:
                    self.embeddings.release_done(request)

        # Then waiting requests, oldest first, unless memory was just short. One whose next
        # tokens are an item still being encoded steps aside for those behind it.
        awaiting_embeddings: list[Request] = []
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a step in flight: its token must arrive first
            if request.grammar is not None and not self._grammar_ready(request):
                if not request.status.finished:  # still compiling: the others go first
                    awaiting_embeddings.append(self.waiting.popleft())
                continue
            cached_blocks = []
            if request.num_computed_tokens == 0:
                cached_blocks = self.kv.find_cached_prefix(request)
            num_cached = len(cached_blocks) * self.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
            if request.input_limit is not None:
                num_new = min(num_new, request.input_limit - request.num_computed_tokens - num_cached)
                if num_new <= 0:
                    awaiting_embeddings.append(self.waiting.popleft())
                    continue
            if request.mm_placeholders:
                num_new = self.embeddings.schedulable(request, request.num_computed_tokens + num_cached, num_new)
                if num_new == 0:
                    awaiting_embeddings.append(self.waiting.popleft())
                    continue
            if self.kv.allocate_slots(request, num_new, cached_blocks) is None:
                self._fail_if_never_fits(request)
                break
            self.waiting.popleft()
            # Counted on admission only: a request that waits is looked up again each step.
            if self.kv.enable_caching:
                self.kv.stats.record(request.num_tokens, num_cached)
            request.num_computed_tokens += num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            block_ids = self.kv.block_ids(request.request_id)
            out.new_requests.append(NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                mm_placeholders=request.mm_placeholders,
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                eos_token_ids=request.eos_token_ids,
                grammar=request.grammar,
            ))
            self.known_to_runner.add(request.request_id)
            out.num_scheduled_tokens[request.request_id] = num_new
            self._advance(request, num_new)
            budget -= num_new
            if request.mm_placeholders:
                self.embeddings.release_done(request)
        self.waiting.extendleft(reversed(awaiting_embeddings))

        out.free_embeddings = self.embeddings.take_freed()
        self._guard_against_stall(out)
        return out

    @staticmethod
    def _advance(request: Request, num_new: int) -> None:
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1

    def _will_have_finished(self, request: Request) -> bool:
        """With tokens still in flight, another step would only compute a token past the end."""
        if not request.num_output_placeholders:
            return False
        params = request.sampling_params
        num_output = request.num_output_tokens + request.num_output_placeholders
        return (num_output >= params.max_tokens
                or request.num_tokens + request.num_output_placeholders >= self.max_model_len)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        # Its items are claimed again (and fetched from the encoder cache) when it resumes.
        self.embeddings.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Tokens of steps still in flight stay pending: they arrive and are kept.
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        # The runner forgets it now; it comes back later as a new request with all tokens.
        out.finished_request_ids.add(request.request_id)
        # Victims come from the end of the running list, past the request being scheduled,
        # so none of them has been given tokens in this step.
        self.known_to_runner.discard(request.request_id)

    def _fail_if_never_fits(self, request: Request) -> None:
        # With nothing running, nothing will free memory: a request that cannot fit into the
        # whole pool (its outputs grew past it) would wait forever.
        if self.running:
            return
        needed = self.kv.blocks_needed(request.num_tokens)
        if needed > self.kv.pool.num_usable_blocks:
            self.waiting.popleft()
            self._fail(request, f"request needs {needed} KV blocks to continue but the pool holds "
                                f"{self.kv.pool.num_usable_blocks}; raise num_kv_blocks or lower max_tokens")

    def _guard_against_stall(self, out: SchedulerOutput) -> None:
        # Waiting on the encoder, a grammar or inputs another stage makes is not a stall: their
        # timeouts (or that stage's end) bound the wait.
        if (out.num_scheduled_tokens or not self.waiting or self.embeddings.num_in_flight
                or self.waiting_on_grammar or any(self._waits_on_inputs(r) for r in self.waiting)
                or any(self._waits_on_inputs(r) for r in self.running)):
            self.stalled_steps = 0
            return
        self.stalled_steps += 1
        if self.stalled_steps >= self.config.max_stalled_steps:
            request = self.waiting.popleft()
            self.stalled_steps = 0
            self._fail(request, f"request made no progress for {self.config.max_stalled_steps} "
                                f"steps (KV blocks free: {self.kv.pool.num_free_blocks})")

    @staticmethod
    def _waits_on_inputs(request: Request) -> bool:
        return request.input_limit is not None and request.num_computed_tokens >= request.input_limit

    def _grammar_ready(self, request: Request) -> bool:
        """True once the request's grammar compiled. A failed or overdue compile fails the
        request (taken off the queue's head) and returns False."""
        grammar = request.grammar
        if grammar.done():
            if not grammar.cancelled() and grammar.exception() is None:
                return True
            message = "the grammar engine shut down" if grammar.cancelled() else str(grammar.exception())
        elif time.monotonic() - request.grammar_asked_at > self.config.grammar_timeout_s:
            message = (f"the grammar did not compile within {self.config.grammar_timeout_s:g} s "
                       "(grammar_timeout_s)")
        else:
            return False
        self.waiting.popleft()
        self._fail(request, message)
        return False

    @property
    def waiting_on_grammar(self) -> bool:
        return any(r.grammar is not None and not r.grammar.done() for r in self.waiting)

    def _fail(self, request: Request, message: str) -> None:
        logger.error("request %s failed: %s", request.request_id, message)
        request.error = message
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self.pending_outputs.append(EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason="error",
            num_cached_tokens=request.num_cached_tokens, error=message))

    # ---- after the model ran ----------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        # This runs for every running request every step: it stays free of property calls
        # and per-request helper calls on the common path.
        for request_id, message in result.errors.items():
            if request_id in self.requests:
                self._fail(self.requests[request_id], message)
        outputs = self.pending_outputs
        self.pending_outputs = []
        requests, sampled, all_logprobs = self.requests, result.sampled_token_ids, result.logprobs
        block_size = self.block_size
        for request_id in sched.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None:
                continue  # finished or aborted while the step ran
            token_id = sampled.get(request_id)
            if token_id is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            request.num_output_placeholders -= 1
            request.output_token_ids.append(token_id)
            tokens = request.all_token_ids
            tokens.append(token_id)
            if len(tokens) // block_size > len(request.block_hashes):
                extend_block_hashes(request, block_size)
            finish = self._check_stop(request, token_id)
            logprobs = all_logprobs.get(request_id) if all_logprobs else None
            outputs.append(EngineCoreOutput(
                request_id, [token_id], finish.value if finish else None, request.stop_reason,
                request.num_cached_tokens, [logprobs] if logprobs is not None else None))
            if finish:
                self._finish(request, finish)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if (len(request.output_token_ids) >= params.max_tokens
                or len(request.all_token_ids) >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, dequeued: bool = False) -> None:
        was_running = request.status is RequestStatus.RUNNING
        request.status = status
        if was_running:
            self.running.remove(request)
        elif not dequeued and request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        if request.mm_placeholders:
            self.embeddings.release(request)
        if request.request_id in self.known_to_runner:
            self.known_to_runner.discard(request.request_id)
            self.finished_ids.add(request.request_id)
        del self.requests[request.request_id]
