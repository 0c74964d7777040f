"""4-bit weights for CPU decoding (`--quantization int4`, and `auto` where it loses nothing).

A one-row product on a CPU is memory-bound: it reads the whole weight matrix to do little
arithmetic, so reading 4 bits a weight instead of bfloat16's 16 makes it faster. The layout
is GGUF's Q4_1: groups of 32 weights along the input, each with a float scale and minimum
(weight = code * scale + minimum, code 0..15). torch's own CPU kernel runs it
(`_weight_int4pack_mm_for_cpu`, bfloat16 activations, float accumulation).

Its arithmetic costs more per row than oneDNN's bfloat16 product, so it wins only while reading
the weights dominates. Measured here over all 210 layers of the default model (each read from
memory, as in serving), against oneDNN bfloat16: 1 row 3x faster, 8 rows 1.5x, 12-16 rows
even, 24 rows slower. So each layer also keeps a bfloat16 copy of the same (dequantized)
weights, oneDNN-packed, for larger batches and prefill chunks.

Checkpoints converted from a Q4_1 GGUF file (the default model is one) hold float weights
that already lie on this grid: for them the 4-bit codes lose nothing, which `on_int4_grid`
checks per layer, and `auto` converts only such layers. What remains is the kernel's bfloat16
scales and zeros (up to ~5% of a step per weight) and bfloat16 activations: the accuracy of
the bf16 mode (perplexity 0.998x of exact on the default model), not exactness.

Memory: the codes, the scales and the bfloat16 copy take ~2.6 bytes per weight, more than
bf16's 2; the gain is in the bytes a decode step reads (0.5 per weight + scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.cpu_packed_linear import PackedLinear

GROUP_SIZE = 32
MAX_CODE = 15
# Up to this many rows the 4-bit kernel runs; more rows use the bfloat16 copy (see above).
MAX_INT4_ROWS = 8
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

    def kernel_weights(self) -> torch.Tensor:
        """The float32 weights the kernel multiplies by (its bfloat16 scales and zeros applied)."""
        n, k = self.codes.shape
        scale_zero = self.kernel_scales_and_zeros().float()  # [G, N, 2]
        scales, zeros = scale_zero[..., 0].t().unsqueeze(-1), scale_zero[..., 1].t().unsqueeze(-1)
        groups = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return ((groups - 8) * scales + zeros).view(n, k)


def kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


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
    """`nn.Linear` on 4-bit weights for up to MAX_INT4_ROWS rows, on their bfloat16 copy for more.
    Takes and returns float32 (the input is rounded to bfloat16, as in the bf16 mode); the
    bias stays float32 (added here, not by the copy)."""

    def __init__(self, linear: torch.nn.Linear, quantized: Int4Weight) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Plain attributes, not buffers: reading a buffer goes through nn.Module.__getattr__
        # (~1 us), and these are read ~200 times per token. The module lives on the CPU only.
        self.packed_codes, self.scales_and_zeros = quantized.packed()
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self._product = torch.ops.aten._weight_int4pack_mm_for_cpu.default
        # Batches run on the weights the kernel uses (its bfloat16 scales and zeros applied),
        # so a request's numbers move only by rounding when its step grows past MAX_INT4_ROWS.
        dense = torch.nn.Linear(self.in_features, self.out_features, bias=False)
        dense.weight.data = quantized.kernel_weights()
        self.batched = PackedLinear(dense, torch.bfloat16)
        # Modeling code may read `layer.weight.dtype` / `.shape`: see PackedLinear.
        self.weight = self.batched.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Kept to the fewest torch calls: this runs ~200 times per decoded token.
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_INT4_ROWS:
            return self.batched(x) if self.bias is None else self.batched(x) + self.bias
        out = self._product(rows.to(torch.bfloat16), self.packed_codes, GROUP_SIZE, self.scales_and_zeros).float()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 groups of {GROUP_SIZE} (bfloat16 copy above {MAX_INT4_ROWS} rows)")
