"""A greedy answer does not depend on what else the server runs: a stream's tokens and
log-probabilities are bitwise those it gets alone when other requests' prompts share its steps
(the runner puts a step's generated tokens first; 4-bit and float32 products compute them as in
a step of their own: workers/cpu/row_layout.py). benchmarks/greedy_under_load.py checks the same on
the default model through the server."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.request import Request
from workers import model_runner
from workers.batch_planning import RunnerRequest, leading_generated_rows
from workers.cpu import native_library
from workers.cpu.row_layout import StepRows
from workers.forward_context import get_forward_context, set_forward_context
from workers.cpu.float32_linear import Float32Linear, rows_for_onednn
from workers.cpu.int4 import Int4Linear


def greedy_answer(core, prompt: list[int], others: dict[int, list[int]]) -> list:
    """Request "a"'s (token, log-probabilities) pairs, with each of `others` (steps after a's
    prompt -> a prompt, greedy without log-probabilities) arriving after that many of a's steps.
    (Log-probabilities come from float32 logits of the rows that ask for them, in one product
    whose last bits may depend on how many rows do: here a's row alone in every step.)"""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    core.add_request(Request("a", prompt, params))
    answer, steps = [], 0
    while core.has_unfinished_requests:
        if steps in others:
            core.add_request(Request(f"other-{steps}", others[steps],
                                     SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
        for out in core.step():
            if out.request_id == "a":
                answer += [(token, lp.top) for token, lp in zip(out.new_token_ids, out.logprobs)]
        steps += 1
    return answer


def assert_the_same_under_load(llm: LLM, loads: list[dict[int, list[int]]]) -> None:
    core = llm.engine.core
    prompt = list(range(5, 29))
    alone = greedy_answer(core, prompt, {})
    assert len(alone) == 6
    for others in loads:
        # A fresh cache each time: a's prompt computed as it was alone.
        assert core.reset_prefix_cache()
        assert greedy_answer(core, prompt, others) == alone


def test_a_4bit_greedy_answer_does_not_depend_on_other_requests_prompts_sharing_its_steps(tiny_llama, int4_kernel):
    """The step that computes another prompt takes the bfloat16 copy for that prompt's rows
    only (before, for all: 11 of 12 greedy answers of the default model changed under load)."""
    llm = LLM(str(tiny_llama), quantization="int4", num_kv_blocks=64, block_size=16)
    assert isinstance(llm.engine.core.executor.model.model.layers[0].mlp.down_proj, Int4Linear)
    assert_the_same_under_load(llm, [{2: list(range(40, 80))}, {1: list(range(90, 93)), 3: list(range(100, 140))}])


def test_an_exact_mode_greedy_answer_does_not_depend_on_a_long_prompt_sharing_its_steps(tiny_llama):
    """A step of oneDNN's number of rows (a long prompt chunk beside a decoding stream) computes
    the stream's row in a native product call of its own, not in oneDNN's."""
    if not native_library.float32_product_available():
        pytest.skip("exact mode's layers are oneDNN's without the native float32 product (AVX-512F)")
    llm = LLM(str(tiny_llama), quantization="none", num_kv_blocks=128, block_size=16)
    assert isinstance(llm.engine.core.executor.model.model.layers[0].mlp.down_proj, Float32Linear)
    long_prompt = [5 + i % 190 for i in range(rows_for_onednn() + 40)]
    assert_the_same_under_load(llm, [{2: long_prompt}, {1: long_prompt[:rows_for_onednn()], 3: list(range(100, 140))}])


def test_the_runner_marks_where_a_steps_prompt_tokens_begin(tiny_llama, monkeypatch):
    """A step's rows of generated tokens come first, whatever order the scheduler gives (here
    the reverse of its own), and the rows from the first one that computes a prompt token, of
    one token or more, take the prompt's path; steps of generated tokens alone have none."""
    llm = LLM(str(tiny_llama), quantization="int4", num_kv_blocks=64, block_size=16)
    core = llm.engine.core
    marks = []
    step = model_runner.set_forward_context

    def recording(attention, rows):
        marks.append((rows.generated, rows.tokens))
        return step(attention, rows)
    monkeypatch.setattr(model_runner, "set_forward_context", recording)
    schedule = core.scheduler.schedule

    def reversed_schedule():
        sched = schedule()
        sched.num_scheduled_tokens = dict(reversed(sched.num_scheduled_tokens.items()))
        return sched
    monkeypatch.setattr(core.scheduler, "schedule", reversed_schedule)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.add_request(Request("a", list(range(5, 25)), params))
    core.step()  # a's prompt
    core.step()  # a decodes alone
    core.add_request(Request("b", list(range(30, 50)), params))
    core.add_request(Request("c", list(range(60, 61)), params))  # a one-token prompt: one row, still a prompt
    while core.has_unfinished_requests:
        core.step()  # a decodes beside b's and c's prompts, then all decode, then b and c
    assert [generated for generated, _ in marks] == [0, None, 1, None, None, None]
    assert [tokens for generated, tokens in marks if generated is not None] == [20, 1 + 20 + 1]


def runner_request(prompt: int, computed: int, total: int) -> RunnerRequest:
    return RunnerRequest(token_ids=list(range(total)), num_prompt_tokens=prompt,
                         sampling_params=SamplingParams(), block_ids=[], num_computed_tokens=computed,
                         mm_placeholders=[])


def test_only_leading_rows_of_one_generated_token_count_as_generated():
    """A preempted request recomputed past its prompt is a row of several generated tokens: in a
    step with prompt tokens it takes their path, and the count stays a count of tokens."""
    decode, recomputed, prompt = runner_request(4, 9, 10), runner_request(4, 0, 30), runner_request(30, 0, 30)
    recomputed.num_computed_tokens = 5  # its prompt cached, 24 generated tokens to compute
    assert leading_generated_rows([decode, recomputed, prompt], np.array([1, 24, 30])) == 1
    assert leading_generated_rows([decode, prompt], np.array([1, 30])) == 1
    assert leading_generated_rows([prompt], np.array([30])) == 0
    assert leading_generated_rows([decode, decode], np.array([1, 1])) is None
    assert leading_generated_rows([decode, recomputed], np.array([1, 24])) is None


def test_the_float32_product_computes_a_long_steps_generated_rows_in_a_call_of_their_own():
    if not native_library.float32_product_available():
        pytest.skip("the native float32 product needs AVX-512F and the native library")
    linear = torch.nn.Linear(64, 48)
    layer = Float32Linear(linear)
    rows = rows_for_onednn() + 4
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0))
    whole = layer(x)  # one call: oneDNN's
    with set_forward_context(rows=StepRows(rows, 2)):
        split = layer(x)
        assert get_forward_context().rows.generated_rows(rows - 1) == 0  # not the step's rows: all the prompt's way
    assert torch.equal(split[:2], layer(x[:2])) and torch.equal(split[2:], whole[2:])
    assert not torch.equal(split[:2], whole[:2])  # the two kernels round apart, so the test can tell
