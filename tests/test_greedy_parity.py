"""Greedy tokens from the engine equal transformers' generate, whatever the batching."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.reference import hf_greedy
from tests.tiny_models import MULTI_EOS_CONVERSATION

PROMPT_LENGTHS = [3, 17, 30, 45, 64, 9, 100, 33]
MAX_TOKENS = [20, 12, 20, 7, 20, 16, 20, 3]


def make_prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_checkpoints):
    path = tiny_checkpoints[request.param]
    from tests.reference import load_reference_model
    prompts = make_prompts(load_reference_model(path).config.vocab_size)
    expected = [hf_greedy(path, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    return path, prompts, expected


def greedy_params():
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


@pytest.mark.parametrize("engine_kwargs", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=8),
    dict(max_num_batched_tokens=24),
    dict(max_num_batched_tokens=64, block_size=4),
    dict(max_num_seqs=2),
    dict(async_scheduling=True),
    dict(async_scheduling=True, max_num_batched_tokens=8, block_size=4),
], ids=["default", "no-prefix-cache", "budget-8", "budget-24", "budget-64-block-4", "two-seqs", "async",
        "async-budget-8"])
def test_greedy_matches_transformers(case, engine_kwargs):
    path, prompts, expected = case
    llm = LLM(str(path), num_kv_blocks=256, **engine_kwargs)
    outputs = llm.generate(prompts, greedy_params())
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_matches_transformers_under_preemption(case, async_scheduling):
    path, prompts, expected = case
    # 31 usable blocks of 4 tokens: the longest request alone needs 30, so running
    # requests must be preempted and recomputed for everyone to finish.
    llm = LLM(str(path), num_kv_blocks=32, block_size=4, max_num_batched_tokens=32,
              async_scheduling=async_scheduling)
    outputs = llm.generate(prompts, greedy_params())
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("enable_prefix_caching,async_scheduling", [(True, False), (False, False), (True, True)])
def test_second_pass_hits_prefix_cache_and_matches(case, enable_prefix_caching, async_scheduling):
    path, prompts, expected = case
    llm = LLM(str(path), num_kv_blocks=256, block_size=8, enable_prefix_caching=enable_prefix_caching,
              async_scheduling=async_scheduling)
    first = llm.generate(prompts, greedy_params())
    second = llm.generate(prompts, greedy_params())
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    assert all(o.num_cached_tokens == 0 for o in first)
    if enable_prefix_caching:
        # Every full block before the last prompt token is served from the cache.
        assert [o.num_cached_tokens for o in second] == [(n - 1) // 8 * 8 for n in PROMPT_LENGTHS]
        stats = llm.engine.stats()
        assert stats.prefix_cache_hit_tokens == sum((n - 1) // 8 * 8 for n in PROMPT_LENGTHS)
    else:
        assert all(o.num_cached_tokens == 0 for o in second)


def test_shared_prefix_in_one_batch_matches(case):
    """Requests sharing a prefix, submitted together, share blocks registered in the same step."""
    path, prompts, _ = case
    prefix = prompts[6][:64]
    variants = [prefix + p[:5] for p in prompts[:4]]
    expected = [hf_greedy(path, v, 10) for v in variants]
    llm = LLM(str(path), num_kv_blocks=256, block_size=16)
    outputs = llm.generate(variants, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.num_cached_tokens for o in outputs) >= 3 * 64


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stops_on_a_generation_config_eos_that_is_not_the_tokenizers(tiny_multi_eos, async_scheduling):
    llm = LLM(str(tiny_multi_eos), num_kv_blocks=64, async_scheduling=async_scheduling)
    im_end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert llm.tokenizer.eos_token_id != im_end
    prompt = llm.apply_chat_template(MULTI_EOS_CONVERSATION)
    expected = hf_greedy(tiny_multi_eos, prompt, 40, stop_at_eos=True)
    assert expected[-1] == im_end and len(expected) < 40
    out = llm.chat(MULTI_EOS_CONVERSATION, SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.token_ids == expected
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", None, llm.tokenizer.decode(expected[:-1]))
