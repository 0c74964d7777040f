"""The engine's state for one request, owned by the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})


@dataclass(frozen=True)
class MultiModalPlaceholder:
    """Where one multimodal item sits in the prompt; `mm_hash` identifies its content.

    The `length` prompt tokens from `offset` on take the item's `length` embeddings instead
    of token embeddings. `grid` is the item's embedding layout as the model family reads it
    for positions (Qwen2-VL: (t, h, w) in patches before merging); () where positions are 1-D.
    """

    offset: int
    length: int
    mm_hash: str
    modality: str = "image"
    grid: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.length


# Compared by identity: a value comparison of every field made each list removal slow.
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Generating any of these ends the request (unless ignore_eos).
    eos_token_ids: tuple[int, ...] = ()
    mm_placeholders: list[MultiModalPlaceholder] = field(default_factory=list)
    # Keeps tenants apart in the prefix cache: different salts never share a block.
    cache_salt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is computed or being computed by a scheduled step.
    num_computed_tokens: int = 0
    # Tokens being sampled by scheduled steps whose results have not come back yet.
    num_output_placeholders: int = 0
    # Prompt tokens served from the prefix cache the first time the request was scheduled.
    num_cached_tokens: int = 0
    # Hashes of the request's full blocks, extended as tokens arrive; never recomputed.
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    # Structured output: the compile of the request's grammar (a Future); it is not
    # scheduled before that is done, and fails if the compile fails. When it was asked for.
    grammar: object | None = None
    grammar_asked_at: float = 0.0
    # Positions whose inputs exist yet (an omni talker's: rows the thinker has made so far);
    # none past it is scheduled. None: every input exists (its tokens).
    input_limit: int | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
