"""RMSNorm layers of float32 CPU models run as one fused call, with bitwise the same output."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from engine import LLM
from workers.fused_rms_norm import FusedRMSNorm, fuse_rms_norms


class OnePlusWeightRMSNorm(torch.nn.Module):
    """Gemma's formula (scale by 1 + weight): not the fused call's, so it must be kept."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.mark.parametrize("norm_class", [LlamaRMSNorm, Qwen2RMSNorm])
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_fused_norm_output_is_bitwise_the_original(norm_class, hidden):
    torch.manual_seed(0)
    original = norm_class(hidden, eps=1e-5)
    with torch.no_grad():
        original.weight.normal_()
    model = torch.nn.Sequential(original)
    assert fuse_rms_norms(model) == 1 and isinstance(model[0], FusedRMSNorm)
    for rows in (1, 3, 257):
        x = torch.randn(1, rows, hidden) * 5
        assert torch.equal(model[0](x), original(x))


def test_a_norm_with_another_formula_is_kept():
    model = torch.nn.Sequential(OnePlusWeightRMSNorm(32), LlamaRMSNorm(32))
    assert fuse_rms_norms(model) == 1
    assert isinstance(model[0], OnePlusWeightRMSNorm) and isinstance(model[1], FusedRMSNorm)


def test_the_engine_serves_float32_cpu_models_with_fused_norms(tiny_llama):
    model = LLM(str(tiny_llama), num_kv_blocks=16).engine.core.executor.model
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and not any(isinstance(m, LlamaRMSNorm) for m in model.modules())
    assert all(isinstance(m, FusedRMSNorm) for m in norms)
