"""What the scheduler tells the model runner each step, and what comes back.

Plain data only: this is the seam that lets the runner live in another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import MultiModalPlaceholder
from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or lost on preemption): everything it needs."""

    request_id: str
    # All known tokens: the prompt, plus earlier outputs when resuming after preemption.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    mm_placeholders: list[MultiModalPlaceholder] = field(default_factory=list)
    # Where a structured answer may end (its grammar allows these once it is complete), and
    # its compiled grammar (a done Future: the scheduler waited for it; in-process only).
    eos_token_ids: tuple[int, ...] = ()
    grammar: object | None = None


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed since last step.

    Parallel lists rather than one object per request: this is built every step for
    every running request, so it must cost next to nothing.
    """

    request_ids: list[str] = field(default_factory=list)
    # Block ids appended since the last step; empty for most decodes.
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def append(self, request_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.request_ids.append(request_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: CachedRequestData = field(default_factory=CachedRequestData)
    # request id -> tokens to compute this step, in batch order (decodes first).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests the runner must forget: finished, aborted or preempted since last step.
    finished_request_ids: set[str] = field(default_factory=set)
    # Item embeddings (mm_hash -> [n, hidden] tensor) the runner adds before this step, and
    # the ones it drops after it: no request scheduled later needs them.
    new_embeddings: dict[str, object] = field(default_factory=dict)
    free_embeddings: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    # Requests whose step reached their last known token produce one new token.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Top-n (token id, logprob) pairs plus the sampled token's own logprob, when asked for.
    logprobs: dict[str, "TokenLogprobs"] = field(default_factory=dict)
    # Requests that cannot go on (their grammar failed to compile): request id -> why.
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class TokenLogprobs:
    sampled_logprob: float
    top: list[tuple[int, float]]
