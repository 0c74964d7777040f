"""The default model's fast path on x86-64 CPUs without AVX-512 (AVX2, FMA and F16C): the native
4-bit kernel's AVX2 variant (workers/cpu/csrc/int4_product_avx2.cpp) for generated rows, and a
float32 copy of the same weights for prompt rows where oneDNN has no bfloat16 product.

(Test names here avoid the words that tests/conftest.py skips on such CPUs: these run there.)"""

import pytest
import torch

from tests.test_cpu_int4 import linear_on_grid, native_reference
from workers.cpu import int4, linear_modes, native_library, row_layout
from workers.cpu.row_layout import KernelRowLimits, StepRows
from workers.forward_context import set_forward_context
from workers.cpu.int4 import Int4Linear, quantize_int4
from workers.cpu.linear_modes import prepare_linear_layers
from workers.cpu.packed_linear import PackedLinear


def native_isa() -> str:
    if not native_library.wait_until_built(timeout=600):
        pytest.skip("the native library is not built here")
    return torch.ops.antiphon_cpu.int4_product_isa()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 40])
def test_the_avx2_kernel_computes_the_8bit_input_times_the_four_bit_codes(rows):
    if native_isa() == "none":
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    if not native_library.int4_product_available():
        pytest.skip("the native library cannot serve here")
    linear = linear_on_grid(160, 48, seed=rows)
    quantized = quantize_int4(linear.weight)
    product = quantized.product()
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 160, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
    x[0, :32] = 0  # an all-zero group: step 0, no division by it
    x[-1, 32:64] = 1e-42  # a group so small that 127 / max overflows: codes 0, as the VNNI kernel
    out = torch.ops.antiphon_cpu.int4_product_avx2(x, product.codes, product.scales)
    expected = native_reference(x, quantized)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # A row computes the same alone as in its batch.
    assert all(torch.equal(torch.ops.antiphon_cpu.int4_product_avx2(x[i:i + 1], product.codes, product.scales),
                           out[i:i + 1]) for i in range(rows))


def with_awkward_groups(x: torch.Tensor) -> torch.Tensor:
    """`x` (at least 5 rows of 192 inputs) with a group of 32 that holds a NaN, one with an
    infinity, one of huge values, one whose scaled values fall on rounding ties, and
    one of subnormals."""
    x = x.clone()
    x[0, 40] = float("nan")
    x[1, 70] = float("inf")
    x[2, 96:128] = torch.linspace(-1e30, 1e30, 32)
    ties = torch.arange(32) - 15.5
    ties[0] = 127.0  # the step is 1: every other input is a tie, k + 0.5
    x[3, 128:160] = ties
    x[4, 160:192] = torch.linspace(-1e-40, 1e-40, 32)
    return x


def test_the_avx2_kernel_answers_non_finite_values_for_rows_with_a_nan_or_an_infinity():
    """A non-finite input never becomes a finite wrong number: a NaN makes its row's outputs
    NaN, an infinity makes them NaN or infinite; the other rows are untouched."""
    if native_isa() == "none" or not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel does not run here")
    product = quantize_int4(linear_on_grid(192, 32, seed=7).weight).product()
    x = torch.randn(6, 192, generator=torch.Generator().manual_seed(7))
    out = torch.ops.antiphon_cpu.int4_product_avx2(with_awkward_groups(x), product.codes, product.scales)
    assert out[0].isnan().all()
    assert not out[1].isfinite().any()
    assert out[2:].isfinite().all()
    assert torch.equal(out[5], torch.ops.antiphon_cpu.int4_product_avx2(x[5:], product.codes, product.scales)[0])


@pytest.mark.parametrize("rows", [1, 3, 4, 17, 64])
def test_the_avx2_and_vnni_kernels_give_bitwise_the_same_results(rows):
    """A server's answers do not depend on which of the two its CPU runs, for awkward inputs too."""
    if native_isa() != "avx512_vnni":
        pytest.skip("needs a CPU with AVX-512 VNNI to compare with")
    quantized = quantize_int4(linear_on_grid(576, 192, seed=rows).weight)
    product = quantized.product()
    x = torch.randn(max(rows, 5), 576, generator=torch.Generator().manual_seed(rows)) * 3
    x = with_awkward_groups(x)[:rows]
    torch.testing.assert_close(torch.ops.antiphon_cpu.int4_product_avx2(x, product.codes, product.scales),
                               torch.ops.antiphon_cpu.int4_product(x, product.codes, product.scales),
                               rtol=0, atol=0, equal_nan=True)


def test_without_a_bfloat16_product_auto_keeps_quantized_layers_with_a_float32_copy(monkeypatch):
    """On a CPU where oneDNN computes no bfloat16, `auto` serves the layers whose weights are
    4-bit already on the native kernel, and their prompt rows on a float32 copy of those very
    weights (exact for a checkpoint on the grid); other layers stay exact float32."""
    if native_isa() == "none" or not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel does not run here")
    for module in (linear_modes, int4):
        monkeypatch.setattr(module, "can_pack_bf16", lambda: False)
    assert linear_modes.auto_serves_int4("none") and linear_modes.auto_serves_int4("bf16")
    on_grid, other = linear_on_grid(64, 32), torch.nn.Linear(32, 16)
    model = torch.nn.Sequential(on_grid, other)
    counts = prepare_linear_layers(model, "none", int4_where_exact=True)
    assert isinstance(model[0], Int4Linear) and model[0].int4.native
    assert isinstance(model[0].batched, PackedLinear) and model[0].batched.dtype == torch.float32
    assert not isinstance(model[1], Int4Linear) and counts["int4"] == 1
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    # Prompt rows (none of them generated): the float32 copy, the layer's own weights.
    with set_forward_context(rows=StepRows(tokens=5, generated=0)):
        prompt = model[0](x)
    torch.testing.assert_close(prompt, on_grid(x), rtol=1e-5, atol=1e-5)
    # Generated rows: the kernel's 8-bit input.
    generated = model[0](x)  # outside a prompt step every row is generated
    assert torch.equal(generated, model[0].int4(x))
    # The other modes still need a bfloat16 product.
    with pytest.raises(ValueError, match="bfloat16"):
        linear_modes.resolve_quantization("bf16", torch.device("cpu"))
    assert linear_modes.resolve_quantization("int4", torch.device("cpu")) == "int4"


def test_decode_steps_past_the_kernels_rows_take_the_float32_copy_and_match_the_model_bitwise(tmp_path, monkeypatch):
    """Where oneDNN has no bfloat16 product, a decode step of more rows than the native
    kernel's limit runs the 4-bit layers' float32 copy (in the C++ stack and in the Python
    forward alike), fewer rows the kernel: every step's logits are the model's own."""
    from engine import LLM
    from tests.test_lean_decoder import generate_every_kind_of_step, run_both_forwards
    from tests.tiny_models import save_tiny_checkpoint

    if native_isa() == "none" or not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel does not run here")
    for module in (linear_modes, int4):
        monkeypatch.setattr(module, "can_pack_bf16", lambda: False)
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: False)
    # 12 streams then take the copy; up to 10 rows the kernel.
    monkeypatch.setattr(row_layout, "KERNEL_ROW_LIMITS", KernelRowLimits(native_int4=10))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        checkpoint = save_tiny_checkpoint("llama", tmp_path / "llama", hidden_size=128, num_attention_heads=2,
                                          num_key_value_heads=1, intermediate_size=256)
        llm = LLM(str(checkpoint), quantization="int4", num_kv_blocks=256)
        runner = llm.engine.core.executor.runner
        copies = {layer.batched.dtype for layer in llm.engine.core.executor.model.modules()
                  if isinstance(layer, Int4Linear)}
        assert copies == {torch.float32}
        steps = run_both_forwards(monkeypatch, llm, native=True)
        generate_every_kind_of_step(llm)
    finally:
        torch.set_num_threads(threads)
    assert [rows for rows, equal in steps if not equal] == []
    assert {11, 12} & {rows for rows, _ in steps}  # steps past the kernel's 10 rows ran
    assert runner.lean.native.steps > 20


def test_without_a_bfloat16_product_greedy_steps_pick_from_a_four_bit_copy_and_keep_the_float32_winner(monkeypatch):
    """On such a CPU `auto` keeps the default model's output matrix float32, but a greedy step
    picks each row's candidates from a 4-bit copy on the native kernel (an eighth of the bytes
    read) and rescores them in float32: the winner is the float32 argmax of the whole row at
    every position of benchmarks/data/english.txt. Other steps get the float32 logits as they are."""
    from tests.test_cpu_output_layer import english_text_hidden_states
    from workers.cpu.output_layer import RescoredOutputLayer

    if native_isa() == "none" or not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel does not run here")
    for module in (linear_modes, int4):
        monkeypatch.setattr(module, "can_pack_bf16", lambda: False)
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: False)
    model, hidden = english_text_hidden_states(1024)
    with torch.inference_mode():
        exact_logits = model.lm_head(hidden)
    prepare_linear_layers(model, "none", int4_where_exact=True)
    layer = model.lm_head
    assert isinstance(layer, RescoredOutputLayer) and layer.approximate_is_exact
    assert layer.selector.product.native
    with torch.inference_mode():
        # A sampling step: the float32 product, nothing rescored.
        torch.testing.assert_close(layer(hidden[:5]), exact_logits[:5], rtol=1e-5, atol=1e-4)
        layer.greedy_step = True
        picked = []
        for rows in hidden.split(64):
            layer(rows)
            picked.append(layer.greedy_winners)
    assert len(hidden) > 700
    assert torch.equal(torch.cat(picked), exact_logits.argmax(-1))


def test_without_a_bfloat16_product_the_engines_greedy_answers_are_the_float32_products(monkeypatch):
    """Through the engine on the default model: greedy answers with the 4-bit picker are those
    of the float32 product alone (the picker off), alone and in a batch; a row that asks for
    log-probabilities gets the float32 product's logits whole."""
    from engine import LLM, SamplingParams
    from workers.cpu.output_layer import RescoredOutputLayer

    if native_isa() == "none" or not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel does not run here")
    for module in (linear_modes, int4):
        monkeypatch.setattr(module, "can_pack_bf16", lambda: False)
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: False)
    llm = LLM(quantization="auto")
    layer = llm.engine.core.executor.model.get_output_embeddings()
    assert isinstance(layer, RescoredOutputLayer) and layer.approximate_is_exact and layer.selector is not None
    prompts = [[(11 * i + 5 * p) % 4000 + 100 for i in range(24)] for p in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    def answers():
        alone = [llm.generate([prompt], greedy)[0].token_ids for prompt in prompts]
        batched = [out.token_ids for out in llm.generate(prompts, greedy)]
        mixed = llm.generate(prompts[:1], with_logprobs)[0]
        return alone, batched, mixed

    picked_alone, picked_batched, picked_mixed = answers()
    selector, layer.selector = layer.selector, None  # the picker off: the float32 product only
    try:
        product_alone, product_batched, product_mixed = answers()
    finally:
        layer.selector = selector
    assert picked_alone == product_alone and picked_batched == product_batched
    assert picked_mixed.token_ids == product_mixed.token_ids
    assert picked_mixed.logprobs == product_mixed.logprobs
