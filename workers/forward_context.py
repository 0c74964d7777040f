"""What one forward pass needs beside its inputs, set once per step by whoever runs the model
(workers/model_runner.py, decode_graphs.py) and read by the parts that need it: the attention
layers read the step's paged-attention metadata (paged_attention.attend), the CPU products the
step's row layout (cpu/row_layout.py). One object, as vLLM's forward context, so that
transformers' modules, whose signatures we do not own, reach per-step state without it being
threaded through every call.

Per thread: a forward runs entirely in the thread that calls the model, and two engines in one
process (each with its own step thread under asynchronous scheduling) may run at once.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from workers.cpu.row_layout import StepRows


@dataclass(frozen=True)
class ForwardContext:
    # The step's paged_attention.PagedAttentionMetadata or BlockTableMetadata; None outside a
    # step (attention layers then refuse to run).
    attention: Any = None
    rows: StepRows = field(default_factory=StepRows)


class _PerThread(threading.local):
    # A class attribute as the default: reading a thread-local attribute that is missing raises
    # and catches an AttributeError (~1 us), and this is read ~200 times a step.
    context = ForwardContext()


_local = _PerThread()


def get_forward_context() -> ForwardContext:
    """The context of the forward running in this thread (an empty one outside any)."""
    return _local.context


@contextlib.contextmanager
def set_forward_context(attention: Any = None, rows: StepRows | None = None):
    """Run the forward passes inside this block with this step's attention metadata and row
    layout. Both are the step's whole context: what is not given is the default (no attention
    metadata; every row a generated token), not the enclosing block's."""
    previous = get_forward_context()
    _local.context = ForwardContext(attention, StepRows() if rows is None else rows)
    try:
        yield
    finally:
        _local.context = previous
