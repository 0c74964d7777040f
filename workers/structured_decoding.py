"""Grammar-constrained sampling in the model runner: one matcher per constrained request,
and one token bitmask per step for the whole batch.

Grammars are compiled by the engine's GrammarCompiler on its own threads; the scheduler does
not schedule a request before its grammar is ready and hands the runner that compile, so
here it is always done. Each
step, the bitmask of the constrained rows is filled on a second thread, started before the
forward pass and collected just before sampling: the masks are made while the model runs,
and a slow compile never delays them. The matchers follow the runner's own token lists (the
tokens sampled so far, also those replayed after a preemption), so they stay right with
asynchronous scheduling, where the runner is the one that knows the tokens.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.grammars import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class ConstrainedRequest:
    compiled: Future
    stop_token_ids: list[int]
    matcher: object | None = None
    # Output tokens the matcher has taken; it catches up with the runner's list each step.
    num_accepted: int = 0
    # The grammar is complete: only a stop token may follow (also past an ignored EOS).
    ended: bool = False


@dataclass
class StepMasks:
    """The step's bitmask ([rows, vocab/32] int32; unconstrained rows allow everything), the
    rows it constrains, and the rows whose grammar failed (row -> why)."""

    bitmask: torch.Tensor
    rows: list[int]
    errors: dict[int, str]


class StructuredDecoding:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.requests: dict[str, ConstrainedRequest] = {}
        self._filling = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def add(self, request_id: str, params, eos_token_ids, compiled: Future | None = None) -> None:
        """`compiled`: the compile the scheduler waited for (done); None compiles it here."""
        stops = sorted(set(eos_token_ids) | set(params.stop_token_ids))
        if compiled is None:
            compiled = self.compiler.submit(params.structured_output)
        self.requests[request_id] = ConstrainedRequest(compiled, stops)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def start_step(self, num_rows: int, rows: list[tuple[int, str, list[int], int]]) -> Future:
        """Start filling the masks of a step that samples `num_rows` rows; `rows`: the
        constrained ones, as (row, request id, its token list, its prompt length)."""
        return self._filling.submit(self._fill, num_rows, rows)

    def _fill(self, num_rows: int, rows: list[tuple[int, str, list[int], int]]) -> StepMasks:
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(num_rows, self.compiler.vocab_size)
        masked, errors = [], {}
        for row, request_id, token_ids, num_prompt_tokens in rows:
            state = self.requests[request_id]
            try:
                self._catch_up(state, token_ids, num_prompt_tokens)
                if state.ended:
                    _allow_only(bitmask[row], state.stop_token_ids)
                else:
                    state.matcher.fill_next_token_bitmask(bitmask, row)
            except Exception as exc:  # one request's grammar failing never fails the step
                errors[row] = f"structured output failed: {exc}"
                logger.error("request %s: %s", request_id, errors[row])
                continue
            masked.append(row)
        return StepMasks(bitmask, masked, errors)

    def _catch_up(self, state: ConstrainedRequest, token_ids: list[int], num_prompt_tokens: int) -> None:
        if state.matcher is None:
            state.matcher = self.compiler.matcher(state.compiled.result(), state.stop_token_ids)
        matcher = state.matcher
        for token_id in token_ids[num_prompt_tokens + state.num_accepted:]:
            state.num_accepted += 1
            if state.ended:
                continue  # stop tokens the request ignores (ignore_eos)
            if not matcher.accept_token(token_id):
                raise ValueError(f"token {token_id} does not fit the grammar")
            state.ended = matcher.is_terminated()

    @staticmethod
    def apply(logits: torch.Tensor, masks: StepMasks) -> None:
        """Disallowed tokens of the constrained rows get -inf, in one vectorized call."""
        if not masks.rows:
            return
        import xgrammar

        bitmask = masks.bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=masks.rows)

    def close(self) -> None:
        self._filling.shutdown(wait=False, cancel_futures=True)


def _allow_only(bitmask_row: torch.Tensor, token_ids: list[int]) -> None:
    bitmask_row.zero_()
    for token_id in token_ids:
        if token_id // 32 < bitmask_row.numel():
            # int32 bit 31 is the sign bit: set it through a wrapped value.
            word = int(bitmask_row[token_id // 32]) | (1 << (token_id % 32))
            bitmask_row[token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word
