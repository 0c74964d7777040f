"""RMSNorm layers of float32 CPU models run as one call: F.rms_norm (bitwise the original), or
the native one-pass norm (workers/cpu/csrc/rms_norm.cpp) where the native library is loaded:
float32-accurate, a row's result independent of its batch and the threads."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from engine import LLM, SamplingParams
from workers.cpu import native_library
from workers.cpu.rms_norm import FusedRMSNorm, fuse_rms_norms


@pytest.fixture(scope="module")
def native_norm():
    if not native_library.wait_until_built(timeout=600) or not native_library.rms_norm_available():
        pytest.skip("the native RMSNorm needs the native library and AVX-512F")
    return torch.ops.antiphon_cpu.rms_norm


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


def test_fusing_twice_keeps_each_norms_choice():
    model = torch.nn.Sequential(LlamaRMSNorm(32))
    assert fuse_rms_norms(model, native=False) == 1
    fused = model[0]
    assert fuse_rms_norms(model, native=True) == 0 and model[0] is fused and not fused.native


def test_a_norm_with_another_formula_is_kept():
    model = torch.nn.Sequential(OnePlusWeightRMSNorm(32), LlamaRMSNorm(32))
    assert fuse_rms_norms(model) == 1
    assert isinstance(model[0], OnePlusWeightRMSNorm) and isinstance(model[1], FusedRMSNorm)


@pytest.mark.parametrize("mode, native", [("none", True), ("none", False), ("bf16", False)])
def test_the_engine_serves_float32_cpu_models_with_fused_norms(tiny_llama, mode, native, monkeypatch):
    """Native where the layers run native products (exact mode here) and the kernel runs;
    F.rms_norm for a CPU without it and in modes whose layers are torch's (bf16), even with
    the library loaded: their numbers must not depend on whether it was built in time."""
    available = native_library.wait_until_built(timeout=600) and native_library.rms_norm_available()
    if (native or mode == "bf16") and not available:
        # (bf16 tests the gate: that the norm is not native although it could be.)
        pytest.skip("the native RMSNorm needs the native library and AVX-512F")
    if mode == "none" and not native:
        monkeypatch.setattr(native_library, "rms_norm_available", lambda: False)
    llm = LLM(str(tiny_llama), num_kv_blocks=16, quantization=mode)
    model = llm.engine.core.executor.model
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and not any(isinstance(m, LlamaRMSNorm) for m in model.modules())
    assert all(isinstance(m, FusedRMSNorm) and m.native == native for m in norms)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def float64_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = x.double(), weight.double()
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("hidden", [1, 15, 16, 17, 64, 576, 4100])
def test_the_native_norm_is_float32_accurate(native_norm, hidden):
    """Within a few ulps of the float64 result, as F.rms_norm is; widths off the 16 lanes too."""
    generator = torch.Generator().manual_seed(hidden)
    weight = torch.randn(hidden, generator=generator)
    for rows in (1, 3, 300):
        x = torch.randn(rows, hidden, generator=generator) * 5
        out = native_norm(x, weight, 1e-5)
        assert out.shape == x.shape and out.dtype == torch.float32
        reference = float64_rms_norm(x, weight, 1e-5)
        bound = 8 * torch.finfo(torch.float32).eps * reference.abs() + 1e-30
        assert bool(((out.double() - reference).abs() <= bound).all())
        assert torch.allclose(out, F.rms_norm(x, (hidden,), weight, 1e-5), rtol=1e-5, atol=0)


def test_a_rows_native_norm_does_not_depend_on_its_batch_or_the_threads(native_norm):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(576, generator=generator)
    batch = torch.randn(400, 576, generator=generator)
    alone = torch.cat([native_norm(batch[i:i + 1], weight, 1e-6) for i in range(len(batch))])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(native_norm(batch, weight, 1e-6), alone)
    finally:
        torch.set_num_threads(threads)


def test_the_native_norm_takes_strided_rows_and_keeps_bad_values_in_their_row(native_norm):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, generator=generator)
    x = torch.randn(6, 64, generator=generator)
    assert torch.equal(native_norm(x[::2], weight, 1e-5), native_norm(x[::2].contiguous(), weight, 1e-5))
    assert torch.equal(native_norm(x.t().contiguous().t(), weight, 1e-5), native_norm(x, weight, 1e-5))
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    out = native_norm(x, weight, 1e-5)
    assert out[1].isnan().all() and not out[2].isfinite().all() and out[[0, 3, 4, 5]].isfinite().all()
    assert torch.equal(out[[0, 3]], native_norm(x[[0, 3]], weight, 1e-5))
    assert native_norm(torch.empty(0, 64), weight, 1e-5).shape == (0, 64)
    # A row of zeros: zeros (eps keeps the scale finite).
    assert torch.equal(native_norm(torch.zeros(1, 64), weight, 1e-5), torch.zeros(1, 64))


def test_the_native_norm_refuses_bad_inputs(native_norm):
    weight = torch.randn(64)
    for x, w, message in ((torch.randn(2, 64).double(), weight, "float32"), (torch.randn(2, 3, 64), weight, "rows"),
                          (torch.randn(2, 32), weight, "hidden"), (torch.randn(2, 64), weight.double(), "weight")):
        with pytest.raises(RuntimeError, match=message):
            native_norm(x, w, 1e-5)
    with pytest.raises(RuntimeError, match="eps"):
        native_norm(torch.randn(2, 64), weight, float("nan"))


def test_a_native_module_normalizes_any_leading_shape_as_its_rows(native_norm):
    original = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        original.weight.normal_()
    model = torch.nn.Sequential(original)
    assert fuse_rms_norms(model, native=True) == 1 and model[0].native
    x = torch.randn(2, 5, 64)
    out = model[0](x)
    assert out.shape == x.shape and torch.equal(out.view(10, 64), native_norm(x.view(10, 64), original.weight, 1e-5))
    assert torch.allclose(out, original(x), rtol=1e-5, atol=0)


def test_the_ab_benchmark_runs_and_prints_its_rows(native_norm):
    """benchmarks/native_parts.py, whose A/B the README quotes, still runs (one short round)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "native_parts.py"
    done = subprocess.run([sys.executable, str(script), "--rounds", "1", "--streams", "1", "2", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # The A/B compares what it says: torch's parts in one engine, native in the other.
    assert "torch's engine: native norms [False], native rescoring False" in done.stdout
    assert "native engine: native norms [True], native rescoring True" in done.stdout
    assert "| 1 |" in done.stdout and "| 2 |" in done.stdout and "greedy answers alike:" in done.stdout
