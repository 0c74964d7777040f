"""4-bit weights for CPU decoding (`--quantization int4`, and `auto` where it loses nothing).

A one-row product on a CPU is memory-bound: it reads the whole weight matrix to do little
arithmetic, so reading 4 bits a weight instead of bfloat16's 16 makes it faster. The layout
is GGUF's Q4_1: groups of 32 weights along the input, each with a float scale and minimum
(weight = code * scale + minimum, code 0..15). Two kernels run it, chosen once per process
(`Int4Product`):
- on x86-64 CPUs with AVX-512 VNNI or AVX2, Antiphon's own (workers/cpu/csrc/int4_product.cpp
  and its AVX2 variant, bitwise the same, built with the C++ decode step): llama.cpp's
  method, the input quantized to 8 bits per group of 32 and integer dot products, float16
  scales and minimums (exact for GGUF's Q4_1). Its speed against torch's kernel and oneDNN's
  dense products: benchmarks/int4_kernels.py; the default model's perplexity with either
  kernel: benchmarks/perplexity.py;
- elsewhere torch's own (`_weight_int4pack_mm_for_cpu`: bfloat16 activations, bfloat16
  scales and zeros, float accumulation).

Torch's kernel's arithmetic costs more per row than oneDNN's bfloat16 product, so it wins only
while reading the weights dominates: up to about 8 rows (the native kernel goes further:
row_layout.KernelRowLimits). Each layer also keeps a copy of the same
(dequantized) weights, oneDNN-packed, for larger batches and for prompt tokens
(workers/cpu/row_layout.py): bfloat16, or float32 where oneDNN has no bfloat16 product.

Checkpoints converted from a Q4_1 GGUF file (the default model is one) hold float weights
that already lie on this grid: for them the 4-bit codes lose nothing, which `on_int4_grid`
checks per layer, and `auto` converts only such layers. What remains is the kernels' rounding
of the activations (to 8 bits per group, or to bfloat16) and, with torch's kernel, of the
scales and zeros to bfloat16 (up to ~5% of a step per weight): the accuracy of the bf16 mode
(perplexity within 0.4% of exact on the default model), not exactness.

Memory: the codes, the scales and the bfloat16 copy take ~2.6 bytes per weight, more than
bf16's 2; with a float32 copy (CPUs without a bfloat16 product) ~4.6, about 15% more than
exact mode's 4. The gain is in the bytes a decode step reads (0.5 per weight + scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.cpu.packed_linear import PackedLinear, can_pack_bf16
from workers.forward_context import get_forward_context
from workers.cpu.product_kinds import ProductKind
from workers.cpu.row_layout import split_rows

GROUP_SIZE = 32
MAX_CODE = 15
# Which rows take a 4-bit kernel and which the copy is row_layout.py's rule (KernelRowLimits
# says how many rows each kernel takes). Prompt tokens take the copy at every row count: on the
# native kernel's 8-bit inputs, a prompt's tail after a prefix-cache hit (a step of a few rows)
# moved the default model's greedy answer: on a fresh server the README's question was answered
# "Paris" if asked first and French gibberish once another conversation had cached the system
# prompt. So the tokens a prompt step computes take the copy whatever part of the prompt is
# cached. (Not every cached token came from one: a follow-up turn's prompt holds the previous
# answer, whose cached keys and values its decode steps computed in 4 bits, and a fresh cache
# computes them from the copy.) Generated tokens take the kernel in every step, one that also
# computes another request's prompt included, so that a greedy answer does not depend on the
# server's load.


NATIVE_INT4, TORCH_INT4 = int(ProductKind.NATIVE_INT4), int(ProductKind.TORCH_INT4)


def kernel_rows(rows: int, native: bool) -> int:
    """How many of a product's leading `rows` a 4-bit kernel computes in the running step
    (its row layout: workers/forward_context.py); the rest take the copy."""
    return get_forward_context().rows.kernel_rows(rows, NATIVE_INT4 if native else TORCH_INT4)


def kind_of(native: bool) -> ProductKind:
    return ProductKind.NATIVE_INT4 if native else ProductKind.TORCH_INT4


# A weight "is on the grid" when every group reconstructs within this fraction of its step.
GRID_TOLERANCE = 1e-3
PROBE_ROWS = 16


@dataclass
class Int4Weight:
    codes: torch.Tensor  # [N, K] int32 in 0..15
    scales: torch.Tensor  # [N, K / 32] float32
    minimums: torch.Tensor  # [N, K / 32] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        groups = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (groups * self.scales.unsqueeze(-1) + self.minimums.unsqueeze(-1)).view(n, k)

    def kernel_scales_and_zeros(self) -> torch.Tensor:
        """[K / 32, N, 2] bfloat16 (scale, zero) in the kernel's convention
        weight = (code - 8) * scale + zero, so zero = minimum + 8 * scale."""
        zeros = self.minimums + 8 * self.scales
        return torch.stack([self.scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales and zeros) as the kernel takes them. The packed codes are one row
        per output, so packs of row blocks stack along dim 0 (and the scales along dim 1)."""
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes, 1), self.kernel_scales_and_zeros()

    def native_layout(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(codes, scales and minimums) in the layout of workers/cpu/csrc/int4_product.cpp:
        codes uint8 [N/16, K/32, 4, 64] (two codes a byte, in vpdpbusd's operand order) and
        float16 [N/16, K/32, 2, 16]. Packs of row blocks stack along dim 0. None where float16
        scales and minimums move a weight by more than 2^-8 of its group's largest: values past
        float16's range or deep in its subnormals. In its normal range the rounding stays under
        ~2^-10 (torch's kernel's bfloat16 scales and zeros: ~2^-8); GGUF's Q4_1 values are
        float16 already, and a constant group's scale, which no code uses, may round to 0."""
        n, k = self.codes.shape
        tiles, groups = n // 16, k // GROUP_SIZE
        if n % 16:
            return None
        # [tile, output j, group, pair p, nibble h, input i] -> [tile, group, pair, nibble, 4 * j + i]
        codes = (self.codes.to(torch.uint8).view(tiles, 16, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
                 .reshape(tiles, groups, 4, 2, 64))
        packed = (codes[..., 0, :] | (codes[..., 1, :] << 4)).contiguous()
        exact = self.dequantize().view(n, groups, GROUP_SIZE)
        error = (self.native_weights().view(n, groups, GROUP_SIZE) - exact).abs().nan_to_num(float("inf"))
        if not bool((error <= exact.abs().amax(-1, keepdim=True) * 2.0 ** -8).all()):
            return None
        scales_and_minimums = (torch.stack([self.scales, self.minimums]).view(2, tiles, 16, groups)
                               .permute(1, 3, 0, 2).to(torch.float16).contiguous())
        return packed, scales_and_minimums

    def native_weights(self) -> torch.Tensor:
        """The float32 weights the native kernel multiplies by (float16 scales and minimums)."""
        n, k = self.codes.shape
        groups = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        scales = self.scales.to(torch.float16).float().unsqueeze(-1)
        minimums = self.minimums.to(torch.float16).float().unsqueeze(-1)
        return (groups * scales + minimums).view(n, k)

    def product(self, native: bool | None = None) -> "Int4Product":
        """This weight packed for the native kernel (`native`; by default where the process
        uses it) where its scales fit, else for torch's."""
        layout = self.native_layout() if (native_kernel_available() if native is None else native) else None
        if layout is not None:
            return Int4Product(True, *layout)
        return Int4Product(False, *self.packed())

    def kernel_weights(self) -> torch.Tensor:
        """The float32 weights torch's kernel multiplies by (its bfloat16 scales and zeros applied)."""
        n, k = self.codes.shape
        scale_zero = self.kernel_scales_and_zeros().float()  # [G, N, 2]
        scales, zeros = scale_zero[..., 0].t().unsqueeze(-1), scale_zero[..., 1].t().unsqueeze(-1)
        groups = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return ((groups - 8) * scales + zeros).view(n, k)


def kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def native_kernel_available(wait: bool = True) -> bool:
    """Whether 4-bit weights use the native kernel in this process (the first call waits
    for the native library's build; see native_library.int4_product_available)."""
    from workers.cpu import native_library  # here: native_library imports this module

    return native_library.int4_product_available(wait)


@dataclass(eq=False)
class Int4Product:
    """A 4-bit weight packed for one of the two kernels, as a product x [rows, K] float32 ->
    [rows, N] float32. `rounded`: x already rounded to bfloat16, where the caller has it
    (torch's kernel takes bfloat16; the native one ignores it)."""

    native: bool
    codes: torch.Tensor
    scales: torch.Tensor  # native: scales and minimums; torch's: scales and zeros

    def __post_init__(self) -> None:
        if self.native and not hasattr(torch.ops.antiphon_cpu, "int4_product"):
            raise RuntimeError("the native 4-bit kernel is not loaded (see native_library.int4_product_available)")
        # Resolved once: this runs ~200 times per decoded token.
        self._kernel = (torch.ops.antiphon_cpu.int4_product.default if self.native
                        else torch.ops.aten._weight_int4pack_mm_for_cpu.default)

    def __call__(self, x: torch.Tensor, rounded: torch.Tensor | None = None) -> torch.Tensor:
        if self.native:
            return self._kernel(x, self.codes, self.scales)
        return self._kernel(x.to(torch.bfloat16) if rounded is None else rounded, self.codes, GROUP_SIZE,
                            self.scales).float()

    @property
    def kernel_max_rows(self) -> int:
        """The most rows this kernel takes in the current step (its layout's limits): for the
        output layer's candidate picker, whose picks are rescored in float32 (output_layer.py),
        so prompt steps keep it."""
        return get_forward_context().rows.limits.of(NATIVE_INT4 if self.native else TORCH_INT4)

    @staticmethod
    def concatenate(products: list["Int4Product"]) -> "Int4Product":
        """The products' outputs side by side, as one product (all of one kernel)."""
        native = products[0].native
        if any(p.native != native for p in products):
            raise ValueError("4-bit products of two kernels cannot be concatenated")
        codes = torch.cat([p.codes for p in products])
        scales = torch.cat([p.scales for p in products], dim=0 if native else 1).contiguous()
        return Int4Product(native, codes, scales)

    def column_views(self, sizes: list[int]) -> list[torch.Tensor]:
        """Views of the codes holding each consecutive block of `sizes` outputs."""
        step = 16 if self.native else 1
        assert all(size % step == 0 for size in sizes), "the native layout holds tiles of 16 outputs"
        views, offset = [], 0
        for size in sizes:
            views.append(self.codes[offset // step:(offset + size) // step])
            offset += size
        return views


def can_quantize(linear: torch.nn.Linear) -> bool:
    """Whole groups along the input, and outputs in the kernel's tiles of 16."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % 16 == 0 and kernel_available()


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """Per group of 32 inputs: the minimum and (maximum - minimum) / 15 as the step."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    minimums = groups.amin(-1)
    # A constant group has no step; any positive one reconstructs it exactly (code 0).
    scales = ((groups.amax(-1) - minimums) / MAX_CODE).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((groups - minimums.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, MAX_CODE)
    return Int4Weight(codes.view(n, k).to(torch.int32), scales, minimums)


def on_int4_grid(weight: torch.Tensor, quantized: Int4Weight) -> bool:
    """Whether the 4-bit codes hold the same weights (a checkpoint that was 4-bit already).
    Non-finite weights are never on the grid."""
    n, k = weight.shape
    error = (quantized.dequantize() - weight.float()).abs().reshape(n, k // GROUP_SIZE, GROUP_SIZE).amax(-1)
    return bool((error <= GRID_TOLERANCE * quantized.scales).all())


def int4_if_on_grid(weight: torch.Tensor) -> Int4Weight | None:
    """The 4-bit form of a weight already on the grid, else None. A few rows are checked
    first, so a float checkpoint is turned down after a sliver of its matrix, not all of it."""
    probe = weight[:PROBE_ROWS]
    if not on_int4_grid(probe, quantize_int4(probe)):
        return None
    quantized = quantize_int4(weight)
    return quantized if on_int4_grid(weight, quantized) else None


class Int4Linear(torch.nn.Module):
    """`nn.Linear` on 4-bit weights for a step's rows of generated tokens, up to the kernel's
    limit; on their bfloat16 copy for prompt tokens and for more rows (`kernel_rows`).
    Takes and returns float32 (the kernel rounds the input: see the module docstring); the
    bias stays float32 (added here, not by the copy)."""

    def __init__(self, linear: torch.nn.Linear, quantized: Int4Weight) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Plain attributes, not buffers: reading a buffer goes through nn.Module.__getattr__
        # (~1 us), and these are read ~200 times per token. The module lives on the CPU only.
        self.int4 = quantized.product()
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        # Batches run on the weights the kernel uses (its rounded scales applied), rounded to
        # bfloat16, so when a request's step grows past the kernel's limit its numbers move by
        # rounding: of the weights (to bfloat16; torch's kernel's are already) and, with the
        # native kernel, of its input (from 8 bits per group to bfloat16). A greedy answer
        # may then differ from the one a smaller step gives.
        dense = torch.nn.Linear(self.in_features, self.out_features, bias=False)
        dense.weight.data = quantized.native_weights() if self.int4.native else quantized.kernel_weights()
        # bfloat16 where oneDNN computes it; on CPUs where it cannot (AVX2 without AVX-512), a
        # float32 copy: more memory, but those rows are then computed exactly on its weights.
        self.batched = PackedLinear(dense, torch.bfloat16 if can_pack_bf16() else torch.float32)
        # Plain attributes for rows_product (a submodule is read through nn.Module.__getattr__).
        self._copy = self.batched.rows_product
        self._kind = NATIVE_INT4 if self.int4.native else TORCH_INT4
        # Modeling code may read `layer.weight.dtype` / `.shape`: see PackedLinear.
        self.weight = self.batched.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows_product(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def rows_product(self, rows: torch.Tensor, rounded: torch.Tensor | None = None) -> torch.Tensor:
        """rows [R, in] -> float32 [R, out], the bias added: the step's generated rows on the
        kernel, prompt rows (and too many) on the copy (row_layout.py). `rounded`: rows already
        rounded to bfloat16 by a caller whose other products share that copy (lean_forward.py).
        Kept to the fewest torch calls: this runs ~200 times per decoded token."""
        count = rows.shape[0]
        on_kernel = get_forward_context().rows.kernel_rows(count, self._kind)
        if on_kernel == count:
            out = self.int4(rows, rounded)
        else:  # (a float32 copy ignores `rounded`)
            out = split_rows(count, on_kernel,
                             lambda part: self.int4(rows[part], None if rounded is None else rounded[part]),
                             lambda: self._copy(rows, rounded))
        if self.bias is not None:
            out += self.bias
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 groups of {GROUP_SIZE}, {'native' if self.int4.native else 'torch'} kernel "
                f"({self.batched.dtype} copy above the step's row limit for it and for prompt tokens)")
