"""Which rows of a CPU step are generated tokens and which prompt tokens, for the products that
compute the two kinds apart (set per step by the model runner: `prompt_step`).

The fast CPU products compute prompt tokens another way than generated ones: 4-bit layers
take their bfloat16 copy for prompt tokens (workers/cpu_int4.py says why), and exact mode's
float32 product hands calls of 256 rows or more, long prompt chunks, to oneDNN
(workers/cpu_float32_linear.py). A generated token must not follow the prompt tokens it shares
a step with: when it did (every row of a step with prompt tokens took the copy), a stream's
greedy answer changed whenever another request's prompt arrived while it decoded, 7 of 8
answers of the default model (benchmarks/greedy_under_load.py). So the runner puts a step's
single-token rows of generated tokens first, and a product of the step's rows computes those on
the path a step of generated tokens alone takes and the rest after them on the prompt's
(`split_rows`); every other part of the forward already computes a row from that row alone.

A product whose rows are not the step's tokens (an output layer's sampled rows) treats a step
with prompt tokens as all prompt: `generated_rows` is then 0. Per thread, as a forward runs in
the thread that calls it (workers/paged_attention.py's step metadata likewise).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch


class _Step(threading.local):
    # How many of the step's tokens lead as generated tokens, one per row; None: the step
    # computes no prompt token.
    generated: int | None = None
    tokens = 0  # the step's tokens: the rows of a product of all of them


_step = _Step()


@contextlib.contextmanager
def prompt_step(generated: int | None, tokens: int = 0):
    """Within this block the step's `tokens` rows compute prompt tokens from row `generated` on
    (the rows before it generated tokens); `generated` None: a step without prompt tokens."""
    previous = _step.generated, _step.tokens
    _step.generated, _step.tokens = generated, tokens
    try:
        yield
    finally:
        _step.generated, _step.tokens = previous


def in_prompt_step() -> bool:
    return _step.generated is not None


def generated_rows(rows: int) -> int:
    """How many of a product's leading `rows` are generated tokens: all in a step without
    prompt tokens; in one with, the step's generated rows if the product takes the step's
    tokens, else none."""
    if _step.generated is None:
        return rows
    return _step.generated if rows == _step.tokens else 0


def split_rows(rows: int, leading: int, leading_way: Callable[[slice], torch.Tensor],
               prompt_way: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A product's [rows, ...] output: the `leading` rows computed by `leading_way` (given their
    slice), the others by `prompt_way`. That computes all the rows and the leading ones are then
    overwritten: a step's prompt rows are its bulk, and joining two outputs with torch.cat
    copied them (~15 ms more in a default-model step of 300 prompt tokens and one stream)."""
    if leading >= rows:
        return leading_way(slice(None))
    out = prompt_way()
    if leading > 0:
        out[:leading] = leading_way(slice(0, leading))
    return out
