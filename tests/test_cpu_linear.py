"""The CPU modes of the linear layers (--quantization): exact stays exact, the others convert
every linear, keep the embedding table float, and serve through the whole engine."""

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.reference import hf_greedy
from workers.cpu import int4, linear_modes, native_library
from workers.cpu.float32_linear import Float32Linear
from workers.cpu.int4 import Int4Linear
from workers.cpu.linear_modes import PackedLinear, prepare_linear_layers, resolve_quantization
from workers.cpu.output_layer import RescoredOutputLayer


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_float32_linear_computes_what_f_linear_computes(rows, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(2, rows, 48)
    packed = PackedLinear(linear)
    out = packed(x)
    assert out.shape == (2, rows, 80) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_bf16_linear_takes_and_returns_float32_within_bfloat16_rounding():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    out = PackedLinear(linear, torch.bfloat16)(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, linear(x), rtol=0.05, atol=0.05)


def test_auto_picks_bf16_only_where_the_cpu_has_native_bfloat16(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    assert resolve_quantization("auto", cpu) == "bf16"
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: False)
    assert resolve_quantization("auto", cpu) == "none"
    assert resolve_quantization("int8", cpu) == "int8"
    # CPU kernels are refused on a GPU rather than silently ignored.
    assert resolve_quantization("auto", torch.device("cuda")) == "none"
    with pytest.raises(ValueError, match="CPU mode"):
        resolve_quantization("int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="unused", quantization="fp4")


def test_the_test_suite_runs_in_exact_mode():
    """Parity tests assert exact mode; conftest makes it the default of EngineConfig."""
    assert EngineConfig(model="unused").quantization == "none"


@pytest.mark.parametrize("mode", ["none", "bf16", "int8", "int4"])
def test_every_linear_is_converted_and_the_output_matrix_keeps_float32_weights(tiny_llama, mode, monkeypatch):
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    llm = LLM(str(tiny_llama), quantization=mode, num_kv_blocks=64)
    model = llm.engine.core.executor.model
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    embedding = model.get_input_embeddings().weight
    assert embedding.dtype == torch.float32
    # Exact mode: a float32 output matrix. The others: bfloat16 with each row's top candidates
    # recomputed in float32 from the float weights (the embedding table when tied), never a copy.
    exact_layer = Float32Linear if native_library.float32_product_available() else PackedLinear
    if mode == "none":
        assert isinstance(model.lm_head, exact_layer) and model.lm_head.weight.dtype == torch.float32
    else:
        assert isinstance(model.lm_head, RescoredOutputLayer)
        exact = model.lm_head.exact_weight
        assert exact.dtype == torch.float32 and exact.shape == (model.lm_head.out_features, embedding.shape[1])
        assert (exact.data_ptr() == embedding.data_ptr()) == model.config.tie_word_embeddings
    body = model.model.layers[0].mlp.down_proj
    if mode == "int4":
        assert isinstance(body, Int4Linear)
    elif mode == "int8":
        from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
        assert isinstance(body, DynamicQuantizedLinear)
    elif mode == "none":
        assert isinstance(body, exact_layer)
    else:
        assert isinstance(body, PackedLinear) and body.dtype == torch.bfloat16
    outputs = llm.generate([[5, 9, 2, 7, 11], [3, 3, 8]],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [6, 6]


@pytest.mark.parametrize("kernel", ["native", "onednn"])
def test_exact_mode_matches_transformers_on_either_float32_kernel(tiny_llama, kernel):
    """The native float32 product where the CPU runs it, oneDNN's packed one elsewhere (the
    decision forced off here; conftest restores it after the test)."""
    if kernel == "native" and not native_library.float32_product_available():
        pytest.skip("the native float32 product needs AVX-512F and the native library")
    if kernel == "onednn":
        native_library._state["float32_product"] = False
    prompt = [5, 9, 2, 7, 11, 4, 4, 19]
    llm = LLM(str(tiny_llama), quantization="none", num_kv_blocks=64)
    assert isinstance(llm.engine.core.executor.model.lm_head, Float32Linear if kernel == "native" else PackedLinear)
    [output] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert output.token_ids == hf_greedy(tiny_llama, prompt, 16)


def test_prepare_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="quantization"):
        prepare_linear_layers(torch.nn.Linear(4, 4), "fp4")


def test_auto_serves_a_non_float32_model_as_loaded_and_explicit_modes_refuse_it(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    assert resolve_quantization("auto", cpu, torch.bfloat16) == "none"
    with pytest.raises(ValueError, match="float32"):
        resolve_quantization("int8", cpu, torch.bfloat16)


def test_packed_linear_shows_a_weight_with_the_shape_and_type_modeling_code_reads():
    packed = PackedLinear(torch.nn.Linear(16, 24), torch.bfloat16)
    assert packed.weight.shape == (24, 16) and packed.weight.dtype == torch.float32
    assert packed.weight.untyped_storage().nbytes() <= 4  # a stand-in, not a copy


def test_bf16_keeps_the_bias_in_float32():
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    with torch.no_grad():
        linear.bias.fill_(1000.123)  # bfloat16 keeps ~3 significant digits: 1000.0
        linear.weight.zero_()
    out = PackedLinear(linear, torch.bfloat16)(torch.randn(2, 8))
    torch.testing.assert_close(out, torch.full((2, 4), 1000.123))


def test_modes_that_compute_in_bfloat16_are_refused_at_start_where_onednn_cannot(monkeypatch):
    monkeypatch.setattr(linear_modes, "can_pack_bf16", lambda: False)
    for mode in ("bf16", "int8"):
        with pytest.raises(ValueError, match="use quantization none"):
            linear_modes.resolve_quantization(mode, torch.device("cpu"))
    # 4-bit layers keep a float32 copy there, where the native 4-bit kernel runs
    # (tests/test_cpu_avx2_path.py); without it they are refused too.
    monkeypatch.setattr(int4, "native_kernel_available", lambda wait=True: False)
    with pytest.raises(ValueError, match="native 4-bit kernel .*use quantization none"):
        linear_modes.resolve_quantization("int4", torch.device("cpu"))
    assert linear_modes.resolve_quantization("auto", torch.device("cpu")) in ("none", "bf16")
