"""A greedy answer does not depend on what else the server runs: a stream's tokens and
log-probabilities are bitwise those it gets alone when other requests' prompts share its steps
(the runner puts a step's generated tokens first; 4-bit and float32 products compute them as in
a step of their own: workers/cpu_int4.py, prompt_step). benchmarks/greedy_under_load.py checks
the same on the default model through the server."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.request import Request
from workers.cpu_float32_linear import ROWS_FOR_ONEDNN, Float32Linear
from workers.cpu_int4 import Int4Linear


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
    llm = LLM(str(tiny_llama), quantization="none", num_kv_blocks=128, block_size=16)
    assert isinstance(llm.engine.core.executor.model.model.layers[0].mlp.down_proj, Float32Linear)
    long_prompt = [5 + i % 190 for i in range(ROWS_FOR_ONEDNN + 40)]
    assert_the_same_under_load(llm, [{2: long_prompt}, {1: long_prompt[:ROWS_FOR_ONEDNN], 3: list(range(100, 140))}])
