"""The row rule of the CPU products: which rows of a step a fast kernel computes and which
take the layer's copy. Decided once per step (`StepRows`, built by the model runner and carried
by workers/forward_context.py), read by the Python products and handed as data to the C++
decode stack (`StepRows.kernel_rows_by_kind`): neither side derives it again.

The fast products compute prompt tokens another way than generated ones: 4-bit layers take
their copy for prompt tokens (int4.py says why), and exact mode's float32 product hands calls
of 256 rows or more, long prompt chunks, to oneDNN (float32_linear.py). A generated token must
not follow the prompt tokens it shares a step with, or a stream's greedy answer would change
whenever another request's prompt arrived while it decoded (benchmarks/greedy_under_load.py
measures it; tests/test_greedy_under_load.py pins it). So the runner puts a step's single-token
rows of generated tokens first, and a product of the step's rows computes those on the path a
step of generated tokens alone takes and the rest after them on the prompt's (`split_rows`);
every other part of the forward computes a row from that row alone.

A product whose rows are not the step's tokens (an output layer's sampled rows) treats a step
with prompt tokens as all prompt: `generated_rows` is then 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from workers.cpu.product_kinds import ProductKind


@dataclass(frozen=True)
class KernelRowLimits:
    """The most rows each 4-bit kernel takes in a step; more rows take the layer's copy.

    Torch's kernel costs more arithmetic per row than oneDNN's bfloat16 product, so it wins only
    while reading the weights dominates: 3.2x at 1 row, 1.25x at 8, 0.85x at 16 on the default
    model's layers (benchmarks/int4_kernels.py). The native kernel is faster at every row count
    that benchmark measures up to 512, on AVX-512 VNNI and AVX2 alike, and computes a row the same
    in any step up to there, so a decode row's greedy token does not depend on how many streams
    share its step. These are ratios of per-row costs on any one CPU, not of one CPU's speed:
    the same on every thread count, as each thread runs its share of rows through the same
    kernel. (AMX's bfloat16 tiles might outrun the native kernel at many rows; unmeasured, so
    AMX takes this rule until benchmarks/int4_kernels.py on such a CPU says otherwise.)
    """

    torch_int4: int = 8
    native_int4: int = 512

    def of(self, kind: ProductKind) -> int:
        return self.native_int4 if kind == ProductKind.NATIVE_INT4 else self.torch_int4


KERNEL_ROW_LIMITS = KernelRowLimits()


@dataclass(frozen=True)
class StepRows:
    """A step's row layout: `tokens` rows, of which the leading `generated` are generated
    tokens, one per row, and the rest prompt tokens; `generated` None: no prompt token (then every
    product's rows are generated tokens, whatever its row count). The default, outside any
    step, is a step of generated tokens."""

    tokens: int = 0
    generated: int | None = None
    limits: KernelRowLimits = KERNEL_ROW_LIMITS

    @property
    def computes_prompt(self) -> bool:
        return self.generated is not None

    def generated_rows(self, rows: int) -> int:
        """How many of a product's leading `rows` are generated tokens: all in a step without
        prompt tokens; in one with, the step's generated rows if the product takes the step's
        tokens, else none."""
        if self.generated is None:
            return rows
        return self.generated if rows == self.tokens else 0

    def kernel_rows(self, rows: int, kind: ProductKind) -> int:
        """How many of a 4-bit product's leading `rows` its kernel computes: the generated
        tokens', if the kernel takes that many; the rest take the layer's copy."""
        generated = self.generated_rows(rows)
        return generated if generated <= self.limits.of(kind) else 0

    def kernel_rows_by_kind(self) -> list[int]:
        """For the C++ stack (csrc/decode_stack.cpp): per product kind (its value as index), how
        many of the step's leading rows take the kind's fast kernel."""
        return [self.kernel_rows(self.tokens, kind) if kind.is_int4 else self.tokens for kind in ProductKind]


def split_rows(rows: int, leading: int, leading_way: Callable[[slice], torch.Tensor],
               prompt_way: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A product's [rows, ...] output: the `leading` rows computed by `leading_way` (given their
    slice), the others by `prompt_way`. That computes all the rows and the leading ones are then
    overwritten: a step's prompt rows are its bulk, and joining two outputs with torch.cat would
    copy them (~15 ms in a default-model step of 300 prompt tokens and one stream)."""
    if leading >= rows:
        return leading_way(slice(None))
    out = prompt_way()
    if leading > 0:
        out[:leading] = leading_way(slice(0, leading))
    return out
