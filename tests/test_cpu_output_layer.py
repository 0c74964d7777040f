"""The output layer of every CPU mode but exact (workers/cpu/output_layer.py): a bfloat16 or
4-bit matrix picks each row's top candidates and their logits are computed in float32, so a
greedy token is the float32 winner; rows that need every logit exact (bias, penalties,
logprobs) get them whole."""

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from workers import model_runner
from workers.cpu import linear_modes, native_library
from workers.cpu.output_layer import EXACT_CANDIDATES, RescoredOutputLayer
from workers.cpu.packed_linear import PackedLinear
from workers.sampler import sample


@pytest.fixture(params=["native", "torch"])
def rescore(request) -> bool:
    """Whether output layers made in the test rescore their candidates natively
    (rescore_top.cpp) or with torch's topk and batched product."""
    native = request.param == "native"
    if native and not (native_library.wait_until_built(timeout=600) and native_library.rescore_top_available()):
        pytest.skip("the native rescoring needs AVX-512F and the native library")
    return native

@pytest.mark.parametrize("rows", [1, 5])
def test_output_layer_logits_of_the_top_candidates_are_float32(rows, rescore):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 500, bias=False)
    layer = RescoredOutputLayer(linear, native_rescore=rescore)
    hidden = torch.randn(1, rows, 64)
    logits = layer(hidden)
    exact = F.linear(hidden, linear.weight)
    assert logits.shape == exact.shape and logits.dtype == torch.float32
    top = exact[0].topk(8, dim=-1).indices
    torch.testing.assert_close(logits[0].gather(-1, top), exact[0].gather(-1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    # The tail is bfloat16: close, not exact.
    torch.testing.assert_close(logits, exact, rtol=0.02, atol=0.05)


def test_output_layer_picks_the_float32_winner_where_bfloat16_ties(rescore):
    """Two tokens whose logits differ below bfloat16's step at that size: bf16 alone cannot
    tell them apart, the float32 rescoring does."""
    linear = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[20.0, 0.0], [20.0, 0.01], [1.0, 0.0]]))
    hidden = torch.tensor([[1.0, 1.0]])
    assert PackedLinear(linear, torch.bfloat16)(hidden)[0, 0] == PackedLinear(linear, torch.bfloat16)(hidden)[0, 1]
    assert RescoredOutputLayer(linear, native_rescore=rescore)(hidden).argmax().item() == 1


def test_output_layer_shares_a_tied_embedding_table_and_adds_a_bias_to_exact_logits(rescore):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 100)
    layer = RescoredOutputLayer(linear, native_rescore=rescore)
    assert layer.exact_weight.data_ptr() == linear.weight.data_ptr()
    hidden = torch.randn(3, 32)
    exact = linear(hidden)
    top = exact.topk(EXACT_CANDIDATES // 2, dim=-1).indices
    torch.testing.assert_close(layer(hidden).gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-5)


def test_listed_rows_get_float32_logits_for_the_whole_row():
    """After a logit bias or a grammar mask the winner can sit anywhere in the vocabulary."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 500, bias=False)
    layer = RescoredOutputLayer(linear)
    hidden = torch.randn(1, 3, 64)
    exact = F.linear(hidden, linear.weight)[0]
    layer.full_precision_rows = [1]
    logits = layer(hidden)[0]
    torch.testing.assert_close(logits[1], exact[1], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(logits[0], exact[0], rtol=1e-6, atol=1e-6)  # the others keep their bf16 tail
    layer.full_precision_rows = [0, 1, 2]  # all of them: one float32 product
    torch.testing.assert_close(layer(hidden)[0], exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["int4", "bf16"])
def test_the_loader_gives_native_rescoring_to_models_whose_layers_are_native(tiny_llama, mode, monkeypatch):
    """A model whose 4-bit layers run the native kernel waited for the library: its output layer
    rescores natively. A bf16 model did not wait: torch's, whether or not the library is loaded."""
    if mode == "bf16" and not (native_library.wait_until_built(timeout=600) and native_library.rescore_top_available()):
        pytest.skip("tests the gate: that a bf16 model's rescoring is torch's although the native one could run")
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    llm = LLM(str(tiny_llama), quantization=mode, num_kv_blocks=16)
    layer = llm.engine.core.executor.model.lm_head
    assert isinstance(layer, RescoredOutputLayer)
    native = mode == "int4" and native_library.int4_product_available() and native_library.rescore_top_available()
    assert layer.native_rescore == native
    out = llm.generate([[5, 9, 2]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


class WatchedSelector:
    """Stands in for an output layer's 4-bit candidate picker: records each call's rows and
    runs the real one, or fails the test where it must not run."""

    def __init__(self, selector, allowed: bool = True) -> None:
        self.selector, self.product, self.allowed, self.rows = selector, selector.product, allowed, []

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.allowed:
            pytest.fail("the 4-bit copy ran")
        self.rows.append(rows.shape[0])
        return self.selector(rows)


def test_the_runner_asks_float32_rows_for_bias_penalties_and_logprobs(tiny_llama, monkeypatch):
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    llm = LLM(str(tiny_llama), quantization="bf16", num_kv_blocks=64)
    layer = llm.engine.core.executor.model.lm_head
    assert isinstance(layer, RescoredOutputLayer)
    seen, argmax_equal = [], []
    forward = layer.forward

    def watched(hidden):
        seen.append((list(layer.full_precision_rows), layer.greedy_step))
        logits = forward(hidden)
        if layer.greedy_step:
            argmax_equal.append(torch.equal(layer.greedy_winners, logits.argmax(-1)))
        return logits
    monkeypatch.setattr(layer, "forward", watched)
    # A greedy step takes its tokens from the layer's winners, never from the sampler.
    sampled = []
    monkeypatch.setattr(model_runner, "sample", lambda logits, rows, **kwargs: (
        sampled.append(len(rows)), sample(logits, rows, **kwargs))[1])
    requests = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={7: 50.0}),
                SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=2),
                SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, presence_penalty=1.0)]
    watched = WatchedSelector(layer.selector)
    picks = watched.rows
    monkeypatch.setattr(layer, "selector", watched)
    outputs = llm.generate([[5, 9, 2]] * 4, requests)
    assert outputs[0].token_ids == [7, 7]
    assert seen and all(sorted(rows) == [0, 2, 3] and not greedy for rows, greedy in seen)
    assert layer.full_precision_rows == [] and not layer.greedy_step  # reset after every step
    # Plain greedy rows only: a greedy step; one sampled row among them: not.
    assert picks == []
    seen.clear()
    sampled.clear()
    greedy_tokens = llm.generate([[5, 9, 2]] * 2, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert seen and all(rows == [] and greedy for rows, greedy in seen) and picks
    assert sampled == [] and argmax_equal and all(argmax_equal)
    assert layer.greedy_winners is None  # reset after the step
    # The same tokens as whole float32 rows give (log-probabilities read the whole row).
    assert [o.token_ids for o in greedy_tokens] == [o.token_ids for o in llm.generate(
        [[5, 9, 2]] * 2, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=0))]
    seen.clear()
    picks.clear()
    llm.generate([[5, 9, 2]] * 2, [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                   SamplingParams(temperature=0.8, max_tokens=2, ignore_eos=True)])
    assert seen and not any(greedy for _, greedy in seen) and picks == []


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_a_greedy_step_picks_candidates_from_the_4bit_copy_and_only_float32_logits_win(rows, bias, monkeypatch,
                                                                                         int4_kernel, rescore):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 512, bias=bias)
    with torch.no_grad():
        if bias:
            linear.bias.normal_(0, 3)  # large enough to reorder the candidates if it were left out
    layer = RescoredOutputLayer(linear, native_rescore=rescore)
    assert layer.selector.product.native == int4_kernel
    hidden = torch.randn(rows, 64) * 3
    exact = linear(hidden)
    layer.greedy_step = True
    monkeypatch.setattr(layer.approximate, "forward", lambda x: pytest.fail("the bfloat16 product ran"))
    logits = layer(hidden)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    # The runner reads each row's winner from the layer instead of an argmax over the row.
    assert torch.equal(layer.greedy_winners, exact.argmax(-1))
    top = exact.topk(8, dim=-1).indices
    torch.testing.assert_close(logits.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-5)
    # Every other logit is out of the running: only the float32 candidates can win.
    assert (logits == float("-inf")).sum(-1).tolist() == [512 - EXACT_CANDIDATES] * rows


def test_a_greedy_step_above_the_4bit_rows_takes_the_bfloat16_product(monkeypatch, int4_kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 512, bias=False)
    layer = RescoredOutputLayer(linear)
    layer.greedy_step = True
    monkeypatch.setattr(layer, "selector", WatchedSelector(layer.selector, allowed=False))
    hidden = torch.randn(layer.selector.product.kernel_max_rows + 1, 64)
    assert torch.equal(layer(hidden).argmax(-1), F.linear(hidden, linear.weight).argmax(-1))
    # A vocabulary the kernel does not take (not a multiple of 16) has no 4-bit copy.
    assert RescoredOutputLayer(torch.nn.Linear(64, 500)).selector is None


def english_text_hidden_states(max_positions: int):
    """(the default model in float32, its final hidden states [positions, hidden] at the first
    `max_positions` positions of benchmarks/data/english.txt, final norm applied)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.checkpoint import ensure_default_model

    path = ensure_default_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    text = (Path(__file__).parent.parent / "benchmarks" / "data" / "english.txt").read_text()
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids[:, :max_positions]
    with torch.inference_mode():
        return model, model.model(input_ids=ids).last_hidden_state[0]


def test_the_4bit_candidates_hold_the_float32_winner_at_every_position_of_the_english_text(int4_kernel, rescore):
    """The default model's final hidden states at every position of benchmarks/data/english.txt:
    the greedy path's winner is the float32 argmax of the whole row, at every one."""
    model, hidden = english_text_hidden_states(2048)
    with torch.inference_mode():
        exact_winners = model.lm_head(hidden).argmax(-1)
        layer = RescoredOutputLayer(model.lm_head, native_rescore=rescore)
        assert layer.selector.product.native == int4_kernel
        layer.greedy_step = True
        winners, picked = [], []
        for rows in hidden.split(layer.selector.product.kernel_max_rows):
            winners.append(layer(rows).argmax(-1))
            picked.append(layer.greedy_winners)
    assert len(exact_winners) > 700
    assert torch.equal(torch.cat(winners), exact_winners) and torch.equal(torch.cat(picked), exact_winners)
