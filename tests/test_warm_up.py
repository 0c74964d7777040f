"""The server's start-up warm-up runs real steps and leaves nothing a user could see: no cached
prefix, no used block, zero statistics, the same greedy tokens afterwards."""

import pytest

from engine import LLM, SamplingParams
from engine.warm_up import MAX_TOKENS, warm_up, warm_up_prompts
from tests.reference import hf_greedy

PROMPT = [5, 9, 2, 33, 17, 8, 41, 6, 12, 3, 27, 19, 4, 30, 11, 7, 22, 14, 1, 25]


def stats_a_user_sees(llm: LLM) -> dict:
    stats = llm.engine.core.stats()
    return dict(blocks_used=stats.kv_blocks_used, queried=stats.prefix_cache_query_tokens,
                hits=stats.prefix_cache_hit_tokens, preemptions=stats.num_preemptions,
                running=stats.num_running, waiting=stats.num_waiting)


@pytest.mark.parametrize("engine_kwargs", [dict(), dict(async_scheduling=True), dict(max_num_seqs=1)])
def test_warm_up_runs_steps_then_leaves_a_fresh_engine(tiny_llama, engine_kwargs):
    llm = LLM(str(tiny_llama), **engine_kwargs)
    core = llm.engine.core
    before = stats_a_user_sees(llm)
    assert warm_up(core, core.executor.vocab_size) > 0
    # It ran: its prompts went through the prefix cache lookups, then were forgotten.
    assert stats_a_user_sees(llm) == before
    assert not core.kv.pool.cached and not core.has_unfinished_requests
    # A user's first request finds nothing cached and gets transformers' greedy tokens.
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == hf_greedy(tiny_llama, PROMPT, 8)
    # The runner dropped the warm-up's requests with the user's first step.
    assert set(core.executor.runner.requests) <= {out.request_id}


def test_warm_up_prompts_leave_room_for_their_tokens():
    for max_model_len in (8, 30, 46, 4096):
        for prompt in warm_up_prompts(vocab_size=50, max_model_len=max_model_len):
            assert 1 <= len(prompt) and len(prompt) + max(MAX_TOKENS) <= max_model_len
            assert all(0 <= token < 50 for token in prompt)


def test_an_engine_too_small_for_the_warm_up_is_left_cold(tiny_llama):
    # Two blocks of 16 tokens cannot hold the 40-token prompt: skipped, not failed.
    llm = LLM(str(tiny_llama), num_kv_blocks=2, block_size=16)
    core = llm.engine.core
    assert warm_up(core, core.executor.vocab_size) == 0.0
    assert not core.has_unfinished_requests and stats_a_user_sees(llm)["queried"] == 0
    out = llm.generate([PROMPT[:10]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(tiny_llama, PROMPT[:10], 4)
