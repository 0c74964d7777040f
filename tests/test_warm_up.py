"""The server's start-up warm-up runs the kinds of steps a first request takes, then leaves
nothing a user could see: no cached prefix, no used block, zero statistics, the same greedy
tokens afterwards."""

import pytest

from engine import LLM, SamplingParams
from engine.warm_up import MAX_TOKENS, PROMPT_TOKENS, warm_up, warm_up_prompts
from tests.reference import hf_greedy

PROMPT = [5, 9, 2, 33, 17, 8, 41, 6, 12, 3, 27, 19, 4, 30, 11, 7, 22, 14, 1, 25]


def stats_a_user_sees(llm: LLM) -> dict:
    stats = llm.engine.core.stats()
    return dict(blocks_used=stats.kv_blocks_used, queried=stats.prefix_cache_query_tokens,
                hits=stats.prefix_cache_hit_tokens, preemptions=stats.num_preemptions,
                running=stats.num_running, waiting=stats.num_waiting)


def record_steps(core) -> list[tuple[int, ...]]:
    """Each executed step's scheduled tokens per request, sorted (e.g. (1, 24): a decode beside
    a 24-token prefill)."""
    steps = []
    execute = core.executor.execute

    def recording(sched):
        steps.append(tuple(sorted(sched.num_scheduled_tokens.values())))
        return execute(sched)

    core.executor.execute = recording
    return steps


@pytest.mark.parametrize("engine_kwargs", [dict(), dict(async_scheduling=True)])
def test_warm_up_runs_each_kind_of_step_then_leaves_a_fresh_engine(tiny_llama, engine_kwargs):
    llm = LLM(str(tiny_llama), **engine_kwargs)
    core = llm.engine.core
    before = stats_a_user_sees(llm)
    steps = record_steps(core)
    assert warm_up(core) > 0
    greedy_prompt, sampled_prompt = PROMPT_TOKENS
    assert steps[0] == (greedy_prompt,)  # a prefill alone
    assert (1, sampled_prompt) in steps  # a prefill beside a decode
    # Two rows decoding, then one (a pipelined engine ends with an empty step).
    assert (1, 1) in steps and [step for step in steps if step][-1] == (1,)
    assert stats_a_user_sees(llm) == before
    assert not core.kv.pool.cached and not core.has_unfinished_requests
    # A user's first request finds nothing cached and gets transformers' greedy tokens.
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == hf_greedy(tiny_llama, PROMPT, 8)
    # The runner dropped the warm-up's requests with the user's first step.
    assert set(core.executor.runner.requests) <= {out.request_id}


def test_warm_up_with_one_sequence_at_a_time(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_seqs=1)
    steps = record_steps(llm.engine.core)
    assert warm_up(llm.engine.core) > 0
    assert all(len(step) == 1 for step in steps)
    assert sum(sum(step) for step in steps) == sum(PROMPT_TOKENS) + sum(MAX_TOKENS) - 2


def test_preemptions_during_the_warm_up_are_not_counted(tiny_llama):
    # 17 blocks of 4 tokens: both requests fit alone, not together once they decode.
    llm = LLM(str(tiny_llama), num_kv_blocks=18, block_size=4)
    core = llm.engine.core
    seen = []
    reset = core.reset_prefix_cache
    core.reset_prefix_cache = lambda: (seen.append(core.scheduler.num_preemptions), reset())[1]
    assert warm_up(core) > 0
    assert seen[0] > 0  # it did preempt
    assert stats_a_user_sees(llm)["preemptions"] == 0 and not core.kv.pool.cached


def test_warm_up_prompts_leave_room_for_their_tokens():
    for max_model_len in (10, 30, 46, 4096):
        for prompt in warm_up_prompts(vocab_size=50, max_model_len=max_model_len):
            assert 1 <= len(prompt) and len(prompt) + max(MAX_TOKENS) <= max_model_len
            assert all(0 <= token < 50 for token in prompt)


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_kv_blocks=2, block_size=16),  # the 40-token prompt does not fit
    dict(num_kv_blocks=22, block_size=2),  # 21 blocks: the prompt fits, not its last tokens
])
def test_an_engine_too_small_for_the_warm_up_is_left_cold(tiny_llama, engine_kwargs):
    llm = LLM(str(tiny_llama), **engine_kwargs)
    core = llm.engine.core
    steps = record_steps(core)
    assert warm_up(core) == 0.0
    assert steps == [] and not core.has_unfinished_requests and stats_a_user_sees(llm)["queried"] == 0
    out = llm.generate([PROMPT[:10]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(tiny_llama, PROMPT[:10], 4)
