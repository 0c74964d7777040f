"""Exact mode's float32 linear layers on the native float32 product (csrc/float32_product.cpp).

A decode step's products read every weight once and do two flops with it, so they go as fast
as the weights stream from memory. oneDNN's packed float32 product (packed_linear.py)
streamed the default model's layers at ~15-20 GB/s for one row; the native product lays each
matrix out as one sequential stream per tile of 8 outputs and prefetches ahead in it, 1.4-2x
faster here (`python benchmarks/float32_products.py`). Up to 255 rows a row's result does not
depend on its batch; steps of 256 rows or more (long prefill chunks, where oneDNN's blocking is
1.3x faster) take oneDNN's product on a plain copy of the weights made for the call (a second
copy kept beside the tiles would double exact mode's memory). In such a step the generated
tokens (which lead it) are computed in a call of their own, as in a step of their own, so a
greedy answer does not depend on another request's prompt sharing its steps
(`float32_product`; workers/cpu/row_layout.py).

Its arithmetic is float32 products summed in another order than `F.linear`'s (chains of
fused multiply-adds 16 lanes wide, then the lanes): differences at rounding level, as between
any two GEMM kernels, oneDNN's included. Exact mode's claim, greedy tokens equal to
transformers', is tested with it (tests/test_greedy_parity.py and the rest of the suite run
in this mode).
"""

from __future__ import annotations

import functools

import torch

from workers.forward_context import get_forward_context
from workers.cpu.row_layout import split_rows

# The kernel's tile: 8 outputs, inputs in chunks of 16 (float32_product.cpp's layout).
TILE_OUTPUTS = 8
CHUNK_INPUTS = 16


@functools.cache
def rows_for_onednn() -> int:
    """Calls of this many rows or more take oneDNN's product (float32_product.h)."""
    return int(torch.ops.antiphon_cpu.float32_rows_for_onednn())


def float32_product(kernel, x: torch.Tensor, tiled: torch.Tensor) -> torch.Tensor:
    """x [rows, K] float32 times a tiled weight through `kernel` (the native product): in one
    call, except where the call would take oneDNN's product and this step's generated tokens
    are fewer than its rows: those are then computed again in a native call of their own and
    written over oneDNN's results (row_layout.split_rows)."""
    rows = x.shape[0]
    if rows < rows_for_onednn():  # every row on the native product, whatever its batch
        return kernel(x, tiled)
    return split_rows(rows, get_forward_context().rows.generated_rows(rows), lambda part: kernel(x[part], tiled), lambda: kernel(x, tiled))


def can_tile(linear: torch.nn.Linear) -> bool:
    """Whole tiles of outputs and whole chunks of inputs (every decoder layer of the usual
    models; an output matrix whose vocabulary is not a multiple of 8 stays oneDNN's)."""
    n, k = linear.out_features, linear.in_features
    return n > 0 and k > 0 and n % TILE_OUTPUTS == 0 and k % CHUNK_INPUTS == 0


def tile_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float32 [N/8, K/16, 8, 16] (the kernel's layout), in one copy."""
    n, k = weight.shape
    tiles = weight.detach().float().view(n // TILE_OUTPUTS, TILE_OUTPUTS, k // CHUNK_INPUTS, CHUNK_INPUTS)
    return tiles.transpose(1, 2).contiguous()


class Float32Linear(torch.nn.Module):
    """`nn.Linear` in float32 on the native product. The bias is added after the product."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        ops = torch.ops.antiphon_cpu
        if not (hasattr(ops, "float32_product") and ops.float32_product_supported()):
            raise RuntimeError("the native float32 product is not loaded or this CPU lacks AVX-512F "
                               "(see native_library.float32_product_available)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Plain attributes, not buffers: see Int4Linear (read ~200 times per token).
        self.tiled = tile_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self._kernel = torch.ops.antiphon_cpu.float32_product.default
        # Modeling code may read `layer.weight.dtype` / `.shape`: see PackedLinear.
        self.weight = torch.zeros((), dtype=torch.float32).expand(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows_product(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def rows_product(self, rows: torch.Tensor, rounded: torch.Tensor | None = None) -> torch.Tensor:
        """rows [R, in] -> [R, out], the bias added in place (`rounded` unused: float32 throughout)."""
        out = float32_product(self._kernel, rows, self.tiled)
        if self.bias is not None:
            out += self.bias
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float32, native product"
