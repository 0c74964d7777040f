"""transformers' RMSNorm layers as one call, for float32 models on CPU.

LlamaRMSNorm and its copies (Qwen2, Mistral, Qwen3, ...) compute
weight * (x * rsqrt(mean(x^2) + eps)) with six torch calls. A layer whose output is bitwise
`F.rms_norm`'s on a probe input (so: the same formula) is replaced by one call:

- the native one-pass RMSNorm (csrc/rms_norm.cpp) in models whose layers run native
  products (model_loader.choose_native_parts: exact mode's and 4-bit layers on AVX-512 CPUs):
  ~1 us for a row of the default model against F.rms_norm's ~10 (61 norms per decoded token).
  Its sum of squares runs in another order than ATen's: rounding-level differences from
  transformers', as exact mode's products and decode attention have (its claim is greedy
  tokens equal to transformers': the test suite runs in exact mode);
- else `F.rms_norm`, bitwise the original for float32 on CPU (checked for hidden sizes 64 to
  4096 and 1 to 500 rows), 25 -> 15 us per call.

The choice is made once per model, for all its norms, and the lean forward and the C++ stack
(lean_forward.py, csrc/decode_stack.cpp) read it from the module: a row gets the same numbers
whichever forward serves its step. A variant with another formula, such as Gemma's
1 + weight, is kept as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FusedRMSNorm(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module, native: bool = False) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self.normalized_shape = tuple(norm.weight.shape)
        # Resolved once (the library is loaded when native is asked for): this runs 61 times a token.
        self._native_norm = torch.ops.antiphon_cpu.rms_norm.default if native else None

    @property
    def native(self) -> bool:
        """Whether this norm runs csrc/rms_norm.cpp (fixed when made: the lean forward and
        the C++ stack read it to compute alike)."""
        return self._native_norm is not None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._native_norm is not None:
            rows = hidden_states.reshape(-1, self.normalized_shape[0])
            return self._native_norm(rows, self.weight, self.variance_epsilon).view(hidden_states.shape)
        return F.rms_norm(hidden_states, self.normalized_shape, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.variance_epsilon}, " + ("native" if self.native else "fused")


def fuse_rms_norms(model: torch.nn.Module, native: bool = False) -> int:
    """Replace every equivalent RMSNorm layer of a float32 CPU model, by the native norm if
    `native`; returns how many."""
    replaced = 0
    probe = torch.Generator().manual_seed(0)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # (A norm fused already keeps its choice: a second call must not flip it.)
            if isinstance(child, FusedRMSNorm) or not _looks_like_rms_norm(child):
                continue
            x = torch.randn(3, child.weight.shape[0], generator=probe) * 4
            with torch.no_grad():
                if not torch.equal(child(x), F.rms_norm(x, tuple(child.weight.shape), child.weight,
                                                        child.variance_epsilon)):
                    continue
            setattr(parent, name, FusedRMSNorm(child, native))
            replaced += 1
    return replaced


def _looks_like_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and isinstance(getattr(module, "variance_epsilon", None), float))
