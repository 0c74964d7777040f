"""Grammar-constrained sampling in the model runner: one matcher per constrained request,
and one token bitmask per step for the whole batch.

A request's grammar is compiled on a background thread as soon as the runner first sees the
request, so compiling overlaps its prefill. Each step, the bitmask of the rows that sample
is filled on that thread too, started before the forward pass and collected just before
sampling: the masks are made while the model runs. The matchers follow the runner's own
token lists (the tokens sampled so far, also those replayed after a preemption), so they
stay right with asynchronous scheduling, where the runner is the one that knows the tokens.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.grammars import GrammarCompiler, GrammarError

logger = logging.getLogger(__name__)


@dataclass
class ConstrainedRequest:
    compiled: Future
    stop_token_ids: list[int]
    matcher: object | None = None
    # Output tokens the matcher has taken; it catches up with the runner's list each step.
    num_accepted: int = 0
    # The grammar is complete (a stop token was taken) or was left: no more masking.
    done: bool = False
    error: str | None = None


@dataclass
class StepMasks:
    """The step's bitmask ([rows, vocab/32] int32) and which of its rows are constrained."""

    bitmask: torch.Tensor
    rows: list[int]
    errors: dict[int, str]


class StructuredDecoding:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.requests: dict[str, ConstrainedRequest] = {}
        # One thread: compiles and mask fills run in order, beside the forward pass.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def add(self, request_id: str, params, eos_token_ids) -> None:
        spec = params.structured_output
        if spec is None:
            return
        stops = sorted(set(eos_token_ids) | set(params.stop_token_ids))
        self.requests[request_id] = ConstrainedRequest(self._thread.submit(self.compiler.compile, spec), stops)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def start_step(self, rows: list[tuple[str, list[int]]]) -> Future | None:
        """Start filling the masks of the rows about to sample: (request id, its output
        tokens so far) in sampling order. None when no row is constrained."""
        if not any(request_id in self.requests for request_id, _ in rows):
            return None
        return self._thread.submit(self._fill, rows)

    def _fill(self, rows: list[tuple[str, list[int]]]) -> StepMasks:
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(rows), self.compiler.vocab_size)
        masked, errors = [], {}
        for index, (request_id, output_tokens) in enumerate(rows):
            state = self.requests.get(request_id)
            if state is None or state.done:
                continue
            try:
                self._catch_up(state, output_tokens)
            except GrammarError as exc:
                state.done, state.error = True, str(exc)
            if state.error is not None:
                errors[index] = state.error
                continue
            if state.done:
                continue
            state.matcher.fill_next_token_bitmask(bitmask, index)
            masked.append(index)
        return StepMasks(bitmask, masked, errors)

    def _catch_up(self, state: ConstrainedRequest, output_tokens: list[int]) -> None:
        if state.matcher is None:
            state.matcher = self.compiler.matcher(state.compiled.result(), state.stop_token_ids)
        matcher = state.matcher
        for token_id in output_tokens[state.num_accepted:]:
            state.num_accepted += 1
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                # Only after the grammar ended (a stop token the request ignores, as with
                # ignore_eos): what follows is free.
                state.done = True
                return
        if matcher.is_terminated():
            state.done = True

    @staticmethod
    def apply(logits: torch.Tensor, masks: StepMasks) -> None:
        """Disallowed tokens of the constrained rows get -inf, in one vectorized call."""
        if not masks.rows:
            return
        import xgrammar

        vocab = logits.shape[-1]
        bitmask = masks.bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=masks.rows)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

