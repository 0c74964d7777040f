"""transformers' RMSNorm layers as one fused torch call, for float32 models on CPU.

LlamaRMSNorm and its copies (Qwen2, Mistral, Qwen3, ...) compute
weight * (x * rsqrt(mean(x^2) + eps)) with six torch calls; `F.rms_norm` computes the same in
one: bitwise equal for float32 on CPU (checked for hidden sizes 64 to 4096 and 1 to 500 rows),
25 -> 15 us per call here. The default model runs 61 of them per decoded token.

A layer is replaced only if its class is an RMSNorm with a weight and `variance_epsilon`, and
it gives bitwise the same output as the fused call on a probe input (a variant with another
formula, such as Gemma's 1 + weight, differs and is kept as it is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FusedRMSNorm(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self.normalized_shape = tuple(norm.weight.shape)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.normalized_shape, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.variance_epsilon}, fused"


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Replace every equivalent RMSNorm layer of a float32 CPU model; returns how many."""
    replaced = 0
    probe = torch.Generator().manual_seed(0)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _looks_like_rms_norm(child):
                continue
            x = torch.randn(3, child.weight.shape[0], generator=probe) * 4
            with torch.no_grad():
                if not torch.equal(child(x), F.rms_norm(x, tuple(child.weight.shape), child.weight,
                                                        child.variance_epsilon)):
                    continue
            setattr(parent, name, FusedRMSNorm(child))
            replaced += 1
    return replaced


def _looks_like_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and isinstance(getattr(module, "variance_epsilon", None), float))
