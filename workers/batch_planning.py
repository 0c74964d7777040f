"""A step planned on the host: the runner's request states and the scheduled counts in, one
packed batch of numpy arrays out.

Every scheduled token of every request runs through the model as one packed sequence, so the
plan is the whole layout of a step: which token sits in which row, its position, the cache slot
its key and value go to, each request's block table, and which rows sample. It is plain numpy,
built without the runner or the device, so that each consumer (the attention metadata in
step_attention.py, the decode graphs, the runner's forward) reads one layout instead of deriving
its own, and a test can plan a step from hand-built states. The arrays reach the device later,
in one non-blocking copy each (host_staging.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.request import MultiModalPlaceholder
from engine.sampling_params import SamplingParams


@dataclass
class RunnerRequest:
    """The runner's own copy of a request, kept from the scheduler's deltas (so that the
    runner can live in another process) and read by the planner each step."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    mm_placeholders: list[MultiModalPlaceholder]
    # M-RoPE only: the prompt's [3, num_prompt_tokens] positions; later tokens sit at t + delta.
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    # A talker request's input rows (workers/talker_runner.py TalkerRows); None elsewhere.
    input_rows: object | None = None

    @property
    def computes_prompt(self) -> bool:
        """Whether its next step computes prompt tokens (not only a generated one)."""
        return self.num_computed_tokens < self.num_prompt_tokens


@dataclass
class PackedBatch:
    """One step on the host (numpy); the device copies are made where they are used."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T], or [3, T] for M-RoPE
    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [R, max_blocks]: int32 for the kernels, int64 for the torch path
    counts: np.ndarray  # [R] tokens scheduled per row
    # The leading rows that hold one token each.
    num_decodes: int
    # How many leading rows hold one generated token each; None if no row computes a prompt
    # token (workers/cpu/row_layout.py, StepRows).
    leading_generated: int | None
    sample_rows: list[int]
    logits_index: np.ndarray  # [len(sample_rows)] the packed row whose logits each one samples
    # Per row: first and end position computed this step, and where its tokens start in the
    # batch (arrays: only multimodal steps turn them into lists).
    starts: np.ndarray
    ends: np.ndarray
    query_offsets: np.ndarray


def plan_batch(states: list[RunnerRequest], num_scheduled: list[int], *, block_size: int,
               use_kernels: bool, uses_mrope: bool) -> PackedBatch:
    """The step on the host: token ids, positions, slots, block table, sampled rows.

    `states` are in the step's row order (the runner puts single-token rows first);
    `use_kernels`: the Triton backend reads the block tables (int32); `uses_mrope`: the model
    takes [3, T] positions (Qwen2-VL), from each state's prompt positions."""
    bs = block_size
    num_rows = len(states)
    counts = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_rows)
    ends = starts + counts
    query_offsets = np.cumsum(counts) - counts
    total = int(counts.sum())

    input_ids: list[int] = []
    for state, start, end in zip(states, starts.tolist(), ends.tolist()):
        input_ids.extend(state.token_ids[start:end])
    if len(input_ids) != total:
        raise RuntimeError(f"the runner holds {len(input_ids)} of the {total} tokens scheduled this step")
    positions = np.repeat(starts - query_offsets, counts) + np.arange(total)
    rope_positions = _mrope_positions(states, starts, ends, query_offsets, positions) if uses_mrope else None

    max_blocks = max(len(s.block_ids) for s in states)
    # int32 is what the kernels read; the torch path indexes with int64 and would convert.
    table = np.zeros((num_rows, max_blocks), dtype=np.int32 if use_kernels else np.int64)
    for row, state in enumerate(states):
        table[row, :len(state.block_ids)] = state.block_ids
    row_of_token = np.repeat(np.arange(num_rows), counts)
    slot_mapping = table[row_of_token, positions // bs].astype(np.int64, copy=False) * bs + positions % bs

    # Only requests whose step reaches their last known token produce a new token.
    num_known = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=num_rows)
    sample_rows = np.nonzero(ends == num_known)[0]
    # The leading single-token rows (all of them when the rows were put first).
    not_single = np.nonzero(counts != 1)[0]
    num_decodes = int(not_single[0]) if len(not_single) else num_rows
    return PackedBatch(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        positions=positions if rope_positions is None else rope_positions,
        slot_mapping=slot_mapping,
        block_tables=table,
        counts=counts,
        num_decodes=num_decodes,
        leading_generated=leading_generated_rows(states, counts),
        sample_rows=sample_rows.tolist(),
        logits_index=query_offsets[sample_rows] + counts[sample_rows] - 1,
        starts=starts,
        ends=ends,
        query_offsets=query_offsets,
    )


def leading_generated_rows(states: list[RunnerRequest], counts: np.ndarray) -> int | None:
    """How many leading rows compute one generated token each (the runner puts them first); None
    if no row computes a prompt token. (A row of several generated tokens, a preempted request
    recomputed, is not counted: in a step with prompt tokens it goes their way.)"""
    leading = 0
    while leading < len(states) and counts[leading] == 1 and not states[leading].computes_prompt:
        leading += 1
    return leading if any(state.computes_prompt for state in states[leading:]) else None


def _mrope_positions(states: list[RunnerRequest], starts: np.ndarray, ends: np.ndarray,
                     query_offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[3, T] positions: text tokens share one position on all three axes; an item's
    tokens take their (t, h, w) grid positions; tokens after the prompt are shifted by
    the request's delta."""
    rope = np.broadcast_to(positions, (3, len(positions))).copy()
    for state, start, end, q0 in zip(states, starts.tolist(), ends.tolist(), query_offsets.tolist()):
        if state.mrope_positions is None:
            continue
        prompt_end = min(end, state.num_prompt_tokens)
        if start < prompt_end:
            rope[:, q0:q0 + prompt_end - start] = state.mrope_positions[:, start:prompt_end]
        if end > state.num_prompt_tokens:
            first = max(start, state.num_prompt_tokens)
            rope[:, q0 + first - start:q0 + end - start] += state.mrope_delta
    return rope
