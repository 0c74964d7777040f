"""4-bit CPU weights (--quantization int4, and auto where a checkpoint is 4-bit already): the
kernels, the row rule between kernel and copy, and what the engine answers with them. The
output layer's float32 rescoring is tests/test_cpu_output_layer.py."""

import threading

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from workers.cpu import int4, linear_modes, output_layer, native_library
from workers.cpu.row_layout import KERNEL_ROW_LIMITS, KernelRowLimits, StepRows
from workers.forward_context import get_forward_context, set_forward_context
from workers.cpu.int4 import GROUP_SIZE, Int4Linear, on_int4_grid, quantize_int4
from workers.cpu.linear_modes import prepare_linear_layers
from workers.cpu.packed_linear import PackedLinear


def linear_on_grid(in_features: int, out_features: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    """A layer as a Q4_1 GGUF file holds it and llama.cpp dequantizes it: per group of 32
    inputs a float16 step d = (max - min) / 15 and float16 minimum m, weight = code * d + m."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // GROUP_SIZE
    original = torch.randn(out_features, groups, GROUP_SIZE, generator=generator) * 0.05
    minimums = original.amin(-1, keepdim=True).half().float()
    steps = ((original.amax(-1, keepdim=True) - minimums) / 15).half().float()
    codes = ((original - minimums) / steps).round().clamp(0, 15)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_((codes * steps + minimums).view(out_features, in_features))
    return linear



def native_reference(x: torch.Tensor, quantized: int4.Int4Weight) -> torch.Tensor:
    """What workers/cpu/csrc/int4_product.cpp computes, in float64 after its own rounding of the
    input: per row and group of 32 inputs, integer codes round(x * (127 / max|x|)) (float32
    arithmetic, ties to even) at a step of max|x| / 127, times the 4-bit codes and float16
    scales, plus the float16 minimums times the quantized group's sum, step * sum(codes)."""
    rows, k = x.shape
    n = quantized.codes.shape[0]
    groups = x.view(rows, k // GROUP_SIZE, GROUP_SIZE)
    largest = groups.abs().amax(-1, keepdim=True)
    ratio = torch.full_like(largest, 127.0) / largest  # one division, as there (127 / t is 127 * (1 / t))
    inverse = torch.where((largest > 0) & torch.isfinite(ratio), ratio, torch.zeros_like(largest))
    x_codes = torch.round(groups * inverse).double()
    steps = (largest / 127).double().squeeze(-1)  # [rows, G]
    w_codes = quantized.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).double()
    dots = torch.einsum("rgi,ngi->rng", x_codes, w_codes)  # exact integers
    scales = quantized.scales.half().double()  # [n, G]
    minimums = quantized.minimums.half().double()
    sums = (x_codes.sum(-1).float() * (largest / 127).squeeze(-1)).double()  # [rows, G], float32 there
    return (dots * scales * steps.unsqueeze(1)).sum(-1) + (minimums * sums.unsqueeze(1)).sum(-1)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
def test_the_native_kernel_computes_its_8bit_input_times_the_4bit_weights(rows):
    if not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel needs AVX-512 VNNI or AVX2 and the native library")
    linear = linear_on_grid(160, 48, seed=rows)
    quantized = quantize_int4(linear.weight)
    product = quantized.product()
    assert product.native
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 160, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
    x[0, :32] = 0  # an all-zero group: step 0, no division by it
    out = product(x)
    expected = native_reference(x, quantized)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # Each row alone is bitwise the same as in the batch: a row's numbers do not depend on its step.
    assert all(torch.equal(product(x[i:i + 1]), out[i:i + 1]) for i in range(rows))
    # Side by side, two layers' outputs are bitwise each one's (q/k/v and gate/up fuse this way).
    other = quantize_int4(linear_on_grid(160, 32, seed=rows + 100).weight).product()
    fused = int4.Int4Product.concatenate([product, other])
    assert torch.equal(fused(x), torch.cat([out, other(x)], dim=1))
    views = fused.column_views([48, 32])
    assert [tuple(v.shape[:1]) for v in views] == [(3,), (2,)] and views[1].data_ptr() != views[0].data_ptr()


def test_a_decode_row_computes_the_same_in_a_step_of_any_size_the_engine_schedules(monkeypatch):
    """4-bit layers run decode steps on the native kernel up to as many rows as the engine
    schedules streams by default (max_num_seqs): a row's output does not change when more
    streams join (the bfloat16 copy rounds its inputs otherwise), on every CPU (AMX too). 512 outputs: 32 tiles, shared by the threads by tiles and by rows."""
    if not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel needs AVX-512 VNNI or AVX2 and the native library")
    monkeypatch.setattr(int4, "native_kernel_available", lambda wait=True: True)
    linear = linear_on_grid(128, 512)
    layer = Int4Linear(linear, quantize_int4(linear.weight))
    rows = EngineConfig().max_num_seqs
    x = torch.randn(1, rows, 128, generator=torch.Generator().manual_seed(0))
    out = layer(x)
    assert all(torch.equal(layer(x[:, i:i + 1]), out[:, i:i + 1]) for i in (0, 17, 77, rows - 1))


def test_a_weight_whose_scales_do_not_fit_float16_takes_torchs_kernel_and_so_does_its_whole_copy(monkeypatch):
    """Zero and constant groups (a scale no code uses, rounding to 0) keep the native layout;
    a group past float16's range does not, and an output matrix with one such chunk picks its
    candidates on torch's kernel as a whole (one kernel per copy)."""
    if not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel needs AVX-512 VNNI or AVX2 and the native library")
    weight = linear_on_grid(64, 32).weight.detach().clone()
    weight[0, :32] = 0
    weight[1, 32:] = 0.3
    quantized = quantize_int4(weight)
    product = quantized.product()
    assert product.native
    x = torch.randn(3, 64)
    torch.testing.assert_close(product(x).double(), native_reference(x, quantized), rtol=1e-5, atol=1e-5)
    huge = linear_on_grid(64, 32, seed=2).weight.detach() * 1e7  # steps of ~1e4-1e5: past float16's range
    assert quantize_int4(huge).native_layout() is None and not quantize_int4(huge).product().native
    monkeypatch.setattr(output_layer._Int4Selector, "CHUNK_ROWS", 32)  # the first chunk fits, the second not
    assert output_layer._Int4Selector(torch.randn(64, 64)).product.native
    selector = output_layer._Int4Selector(torch.cat([torch.randn(32, 64) * 0.05, huge]))
    assert not selector.product.native and selector.product.kernel_max_rows == KERNEL_ROW_LIMITS.torch_int4
    assert selector(torch.randn(2, 64)).shape == (2, 64)


def test_the_native_kernel_checks_its_operands():
    if not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel needs AVX-512 VNNI or AVX2 and the native library")
    product = quantize_int4(linear_on_grid(64, 32).weight).product()
    with pytest.raises(RuntimeError, match="inputs"):
        product(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="float32"):
        product(torch.randn(2, 64).double())
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.antiphon_cpu.int4_product(torch.randn(1, 64), product.codes, product.scales.float())
    # Non-contiguous input is taken (copied), and zero rows give zero rows.
    x = torch.randn(64, 3).t()
    assert torch.equal(product(x), product(x.contiguous()))
    assert product(torch.randn(0, 64)).shape == (0, 32)


def test_weights_already_on_the_grid_quantize_exactly_and_others_do_not():
    on_grid = linear_on_grid(96, 40).weight
    quantized = quantize_int4(on_grid)
    assert on_int4_grid(on_grid, quantized)
    torch.testing.assert_close(quantized.dequantize(), on_grid, rtol=0, atol=1e-6)
    generic = torch.randn(40, 96) * 0.02
    assert not on_int4_grid(generic, quantize_int4(generic))
    # A constant group (all codes equal) is on the grid too, without dividing by a zero step.
    constant = torch.full((4, 32), 0.25)
    assert on_int4_grid(constant, quantize_int4(constant))


@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_computes_the_kernels_weights_product_for_single_rows_and_batches(bias, int4_kernel):
    linear = linear_on_grid(128, 80, bias=bias)
    if bias:
        with torch.no_grad():
            linear.bias.normal_()
    quantized = quantize_int4(linear.weight)
    layer = Int4Linear(linear, quantized)
    torch.manual_seed(0)
    limit = KERNEL_ROW_LIMITS.of(int4.kind_of(layer.int4.native))
    assert limit == (KERNEL_ROW_LIMITS.native_int4 if int4_kernel else KERNEL_ROW_LIMITS.torch_int4)
    for rows in (1, 2, limit, limit + 1, 40):
        x = torch.randn(1, rows, 128)
        out = layer(x)
        assert out.shape == (1, rows, 80) and out.dtype == torch.float32
        # The kernel's rounded activations times its weights, then the float32 bias: the product's
        # rounding is relative to the product, so compare it without the bias. Above
        # the kernel's rows: bfloat16 activations times the same weights.
        added = linear.bias if bias else 0
        weights = quantized.native_weights() if int4_kernel else quantized.kernel_weights()
        if rows > limit or not int4_kernel:
            product = F.linear(x.bfloat16().float(), weights)
            torch.testing.assert_close(out - added, product, rtol=0.01, atol=0.005)
        else:
            product = native_reference(x[0], quantized).float()
            torch.testing.assert_close(out[0] - added, product, rtol=1e-5, atol=1e-5)


def test_the_kernels_weights_stay_within_a_small_part_of_a_step_of_the_checkpoints():
    """What "no loss in the codes" leaves: torch's kernel's bfloat16 scales and zeros, a few %
    of a step; the native kernel's float16 scales and minimums are GGUF's own: nothing."""
    linear = linear_on_grid(256, 64, seed=5)
    quantized = quantize_int4(linear.weight)
    step = quantized.scales.repeat_interleave(GROUP_SIZE, dim=1)
    error = (quantized.kernel_weights() - linear.weight).abs() / step
    assert error.max() < 0.08
    assert torch.equal(quantized.native_weights(), linear.weight.detach())


def test_both_paths_multiply_by_exactly_the_kernels_weights(monkeypatch):
    """One-hot rows read the weights back: torch's 4-bit kernel and the bfloat16 copy hold the
    same ones (bfloat16-rounded), those of the kernel's bfloat16 scales and zeros, not the
    float32-scale dequantization."""
    monkeypatch.setattr(int4, "native_kernel_available", lambda wait=True: False)
    linear = linear_on_grid(64, 32, seed=7)
    quantized = quantize_int4(linear.weight)
    layer = Int4Linear(linear, quantized)
    eye = torch.eye(64)
    four_bit = torch.cat([layer(eye[start:start + KERNEL_ROW_LIMITS.torch_int4])
                          for start in range(0, 64, KERNEL_ROW_LIMITS.torch_int4)]).t()
    expected = quantized.kernel_weights().bfloat16().float()
    assert torch.equal(four_bit, expected)
    assert torch.equal(layer.batched(eye).t(), expected)
    assert not torch.equal(quantized.dequantize().bfloat16().float(), expected)


def test_the_native_kernel_and_its_bfloat16_copy_hold_the_float16_scaled_weights():
    """One-hot rows read the native kernel's weights back (up to the rounding of 1 / 127 * 127),
    and the batched copy holds the same weights, bfloat16-rounded."""
    if not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel needs AVX-512 VNNI or AVX2 and the native library")
    linear = linear_on_grid(64, 32, seed=7)
    quantized = quantize_int4(linear.weight)
    layer = Int4Linear(linear, quantized)
    assert layer.int4.native
    eye = torch.eye(64)
    four_bit = torch.cat([layer(eye[start:start + KERNEL_ROW_LIMITS.torch_int4])
                          for start in range(0, 64, KERNEL_ROW_LIMITS.torch_int4)]).t()
    torch.testing.assert_close(four_bit, quantized.native_weights(), rtol=1e-6, atol=1e-7)
    assert torch.equal(layer.batched(eye).t(), quantized.native_weights().bfloat16().float())


def test_the_4bit_kernel_and_the_bfloat16_copy_agree_on_the_same_rows(monkeypatch, int4_kernel):
    """A request's numbers must not depend on how many others share its step beyond rounding:
    both paths multiply by the same weights."""
    linear = linear_on_grid(256, 64, seed=3)
    layer = Int4Linear(linear, quantize_int4(linear.weight))
    x = torch.randn(2, 256)
    four_bit = layer(x)
    with set_forward_context(rows=StepRows(limits=KernelRowLimits(torch_int4=0, native_int4=0))):
        on_the_copy = layer(x)
    # The native kernel's 8-bit input (a step of max|x| / 127 per group of 32) rounds more than
    # bfloat16's: ~0.005 per output here (std), against ~0.001.
    torch.testing.assert_close(on_the_copy, four_bit, rtol=0.01, atol=0.04 if int4_kernel else 0.004)


def test_a_non_contiguous_weight_quantizes():
    weight = linear_on_grid(64, 32).weight.detach().t().contiguous().t()
    assert not weight.is_contiguous()
    assert on_int4_grid(weight, quantize_int4(weight))


def test_explicit_int4_refuses_non_finite_weights():
    linear = torch.nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        prepare_linear_layers(torch.nn.Sequential(linear), "int4")


def test_explicit_int4_quantizes_any_layer_and_keeps_the_kernels_misfits_bfloat16():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 20), torch.nn.Linear(20, 16))
    counts = prepare_linear_layers(model, "int4")
    assert isinstance(model[0], Int4Linear)
    # 20 outputs (the kernel's tiles are 16) and 20 inputs (groups of 32): bfloat16, and logged so.
    assert all(isinstance(model[i], PackedLinear) and model[i].dtype == torch.bfloat16 for i in (1, 2))
    assert counts == {"int4": 1, "bf16": 2}


def test_auto_serves_4bit_only_the_layers_that_were_4bit_already():
    model = torch.nn.Sequential(linear_on_grid(64, 32), torch.nn.Linear(32, 16), linear_on_grid(64, 32, seed=1))
    with torch.no_grad():  # on the grid but for one weight in the last row: the probe passes, the whole check not
        model[2].weight[31, 7] += 1e-3
    counts = prepare_linear_layers(model, "bf16", int4_where_exact=True)
    assert isinstance(model[0], Int4Linear)
    assert all(isinstance(model[i], PackedLinear) and model[i].dtype == torch.bfloat16 for i in (1, 2))
    assert counts == {"int4": 1, "bf16": 2}


def test_the_default_model_is_4bit_already_so_auto_serves_every_layer_4bit(monkeypatch):
    """Its checkpoint comes from a Q4_1 GGUF file: its 4-bit codes lose nothing."""
    from transformers import AutoModelForCausalLM

    from engine.checkpoint import ensure_default_model

    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32)
    counts = prepare_linear_layers(model, "bf16", int4_where_exact=True)
    assert counts == {"int4": 30 * 7, "output bf16 (top candidates float32)": 1}
    # Tied output matrix: its exact candidates come from the embedding table itself.
    assert model.lm_head.exact_weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_auto_mode_keeps_the_default_models_perplexity_within_its_bound(int4_kernel, monkeypatch):
    """The bound `auto` promises (linear_modes.AUTO_PERPLEXITY_BOUND of exact mode's) on
    benchmarks/data/english.txt, each 4-bit kernel scoring whole windows, as one stream's
    decode steps use it (a native kernel whose minimums' term took the plain input sum stood
    at 1.027x)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    import perplexity

    from workers.cpu.linear_modes import AUTO_PERPLEXITY_BOUND

    scores = {}
    for mode in ("none", "auto"):
        monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
        model, tokenizer, _ = perplexity.load_text_model(mode)
        if mode == "auto":
            layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
            assert len(layers) == 210 and all(layer.int4.native == int4_kernel for layer in layers)
        ids = tokenizer(perplexity.TEXT.read_text())["input_ids"]
        with set_forward_context(rows=StepRows(limits=KernelRowLimits(torch_int4=512, native_int4=512))):
            scores[mode] = perplexity.perplexity(model, ids, 512)
    assert 20 < scores["none"] < 40
    assert scores["auto"] / scores["none"] <= AUTO_PERPLEXITY_BOUND, scores


def test_the_kernel_benchmark_runs_and_prints_each_kernels_row():
    """benchmarks/int4_kernels.py, whose table the README quotes, still runs (one short pass)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "int4_kernels.py"
    done = subprocess.run([sys.executable, str(script), "--rows", "1", "3", "--reps", "1"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    header, _, *rows = [line for line in done.stdout.splitlines() if line.startswith("|")]
    kinds = (["native"] if native_library.int4_product_available() else []) + ["torch", "bf16"]
    assert header.split(" | ")[1:1 + len(kinds)] == kinds
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 3"]
    assert all(float(cell) > 0 for row in rows for cell in row.strip("| ").split(" | ")[1:1 + len(kinds)])


def test_prompt_tokens_take_the_bfloat16_copy_at_every_row_count_and_generated_ones_the_kernel(int4_kernel):
    linear = linear_on_grid(128, 80, bias=True)
    layer = Int4Linear(linear, quantize_int4(linear.weight))
    torch.manual_seed(3)
    x = torch.randn(1, 3, 128)
    outside = layer(x)
    with set_forward_context(rows=StepRows(3, 0)):
        assert int4.kernel_rows(3, int4_kernel) == 0 and get_forward_context().rows.computes_prompt
        inside = layer(x)
        with set_forward_context(rows=StepRows(3)):
            assert int4.kernel_rows(3, int4_kernel) == 3
        assert get_forward_context().rows.computes_prompt
        # Per thread: another thread's forward is not in this step.
        seen = []
        worker = threading.Thread(target=lambda: seen.append(get_forward_context().rows.computes_prompt))
        worker.start()
        worker.join()
        assert seen == [False]
    assert not get_forward_context().rows.computes_prompt
    assert torch.equal(inside, layer.batched(x) + linear.bias)
    assert torch.equal(layer(x), outside)
    if int4_kernel:  # 8-bit inputs there, bfloat16 ones in a prompt step
        assert not torch.equal(inside, outside)
    # Two generated tokens' rows, then a prompt token's: each row as in a step of its kind.
    with set_forward_context(rows=StepRows(3, 2)):
        split = layer(x)
        # A product of other rows than the step's tokens (an output layer's) takes the copy.
        assert torch.equal(layer(x[:, :2]), layer.batched(x[:, :2]) + linear.bias)
    assert torch.equal(split[:, :2], layer(x[:, :2])) and torch.equal(split[:, 2:], inside[:, 2:])
    # More generated rows than the kernel takes: the copy takes them all.
    limit = KERNEL_ROW_LIMITS.of(int4.kind_of(int4_kernel))
    with set_forward_context(rows=StepRows(limit + 2, limit + 1)):
        assert int4.kernel_rows(limit + 2, int4_kernel) == 0


def first_token(llm: LLM, prompt: list[int]):
    """(greedy tokens, the first one's top log-probabilities, prompt tokens from the cache)."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4))[0]
    return out.token_ids, torch.tensor([lp for _, lp in out.logprobs[0].top]), out.num_cached_tokens


@pytest.mark.parametrize("prompt_length,other_prompt", [
    (40, "shares the first block"),  # the prompt's last 24 tokens in a step of their own
    (21, "shares the first block"),  # 5 tokens: within torch's kernel's 8 rows too
    (33, "is the same prompt"),  # its last token alone: a one-row step that computes a prompt token
])
def test_a_prompts_answer_does_not_depend_on_how_much_of_it_is_cached(tiny_llama, int4_kernel, prompt_length,
                                                                      other_prompt):
    """The 4-bit mode computes every prompt token from the bfloat16 copy (row_layout.py: the
    row count alone would give any of these steps a 4-bit kernel), so a prompt computed whole
    and one whose head came from the prefix cache give the same answer and first
    log-probabilities."""
    llm = LLM(str(tiny_llama), quantization="int4", num_kv_blocks=64, block_size=16)
    assert isinstance(llm.engine.core.executor.model.model.layers[0].mlp.down_proj, Int4Linear)
    # Where the C++ decode stack serves, a prompt's last token alone must not take it (4 bits).
    if int4_kernel and native_library.wait_until_built(timeout=600):
        llm.generate([[5, 9, 2]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert llm.engine.core.executor.runner.lean.native is not None
    generator = torch.Generator().manual_seed(11)
    prompt = torch.randint(5, 200, (prompt_length,), generator=generator).tolist()
    whole_tokens, whole_logprobs, cached = first_token(llm, prompt)
    assert cached == 0
    assert llm.engine.core.reset_prefix_cache()
    first = prompt[:16] + [7] * 8 if other_prompt == "shares the first block" else prompt
    llm.generate([first], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    tokens, logprobs, cached = first_token(llm, prompt)
    assert cached == (16 if other_prompt == "shares the first block" else 32)
    assert tokens == whole_tokens
    torch.testing.assert_close(logprobs, whole_logprobs, rtol=0, atol=2e-5)
