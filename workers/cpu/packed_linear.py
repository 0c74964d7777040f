"""A float linear layer whose weight oneDNN holds in its blocked layout (float32 or bfloat16)."""

from __future__ import annotations

import torch


def can_pack() -> bool:
    return torch.backends.mkldnn.is_available()


def can_pack_bf16() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU: it needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT. Every CPU mode but exact has a bfloat16 product (the layers, the output
    matrix), except that 4-bit layers keep a float32 copy for prompt rows where there is none
    (int4.Int4Linear)."""
    return can_pack() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(torch.nn.Module):
    """`nn.Linear` with its weight held in oneDNN's blocked layout, in float32 or bfloat16.
    In bfloat16 the input is rounded to bfloat16 and so is the product (oneDNN returns the
    weight's type); it goes back to float32 before the bias, which stays float32 (Qwen2's
    large q/k biases would lose digits in bfloat16)."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = dtype
        # The batch-size hint only picks the blocking; any number of rows runs with it.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach().to(dtype), 1), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(), persistent=False)
        # The same tensors as plain attributes for rows_product, which runs ~200 times a token: a
        # buffer is read through nn.Module.__getattr__ (~1 us a read).
        self._weight, self._bias = self.packed_weight, self.bias
        # Some modeling code reads `layer.weight.dtype` / `.shape` (e.g. to cast its input):
        # a free stand-in with the shape and the float32 type this module takes.
        self.weight = torch.zeros((), dtype=torch.float32).expand(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rows_product(x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows_product(self, rows: torch.Tensor, rounded: torch.Tensor | None = None) -> torch.Tensor:
        """rows [R, in] -> float32 [R, out], the bias added. `rounded`: rows already rounded to
        bfloat16 by a caller whose other products share that copy (lean_forward.py)."""
        if self.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(rows, self._weight, self._bias, "none", [], "").float()
        if rounded is None:
            rounded = rows.to(self.dtype)
        out = torch.ops.mkldnn._linear_pointwise(rounded, self._weight, None, "none", [], "").float()
        return out if self._bias is None else out + self._bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed {self.dtype}"
