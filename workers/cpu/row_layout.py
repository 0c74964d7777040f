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

    Torch's kernel costs more arithmetic per row than oneDNN's bfloat16 product, so it pays only
    while reading the weights dominates: 3.2x the copy at 1 row, 1.25x at 8, 0.85x at 16 on the
    default model's layers on an AVX-512 VNNI machine (benchmarks/int4_kernels.py). The native
    kernel's limit is set by what it guarantees, not by its speed: up to 512 rows it computes a
    row the same in any step, so a decode row's greedy token does not depend on how many
    streams share its step. It is also faster than the copy up to there on an AVX-512 VNNI
    machine; on an AVX2 one, against the float32 copy such CPUs keep, it is faster up to ~128
    rows and slower from ~256 (0.64x at 256, 0.79x at 512 on the 2-core EPYC), a price paid only
    by steps of that many streams. AMX's bfloat16 tiles might outrun the native kernel at many
    rows; unmeasured, so AMX takes this rule until benchmarks/int4_kernels.py on such a CPU
    says otherwise.
    """

    torch_int4: int = 8
    native_int4: int = 512

    def __post_init__(self) -> None:
        # Per kind, indexed by its value: read ~200 times a step, so no enum lookups then.
        limits = [0] * len(ProductKind)
        limits[ProductKind.TORCH_INT4], limits[ProductKind.NATIVE_INT4] = self.torch_int4, self.native_int4
        object.__setattr__(self, "by_kind", tuple(limits))

    def of(self, kind: int) -> int:
        return self.by_kind[kind]


# The engine's limits: what a step carries unless its runner was given others (tests, benchmarks).
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

    def kernel_rows(self, rows: int, kind: int) -> int:
        """How many of a 4-bit product's leading `rows` its kernel (`kind`, a ProductKind)
        computes: the generated tokens', if the kernel takes that many; the rest take the
        layer's copy."""
        generated = rows if self.generated is None else (self.generated if rows == self.tokens else 0)
        return generated if generated <= self.limits.by_kind[kind] else 0

    def kernel_rows_by_kind(self, rows: int) -> list[int]:
        """For the C++ stack (csrc/decode_stack.cpp), over a product of `rows` rows: per product
        kind (its value as index), how many leading rows take the kind's 4-bit kernel. Entries of
        kinds that are not 4-bit are unused (their kernels have no copy to hand rows to)."""
        return [self.kernel_rows(rows, kind) if kind.is_int4 else rows for kind in ProductKind]


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
