"""Bad input gets a clear ValueError naming the field, and other requests carry on."""

import pytest

from engine import LLM, SamplingParams
from tests.reference import hf_greedy

GOOD = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=64, max_model_len=64)


@pytest.mark.parametrize("prompt,message", [
    ("", "prompt is empty"),
    ([], "prompt_token_ids is empty"),
    ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
    ([1, 2, 10**6], "unknown token id 1000000"),
    ([1, -3], "unknown token id -3"),
    ([1, "x"], "unknown token id 'x'"),
    (list(range(64)), "longer than the context"),
    ({"text": "hi"}, "prompt_token_ids"),
])
def test_bad_prompt_is_a_value_error(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests


def test_bad_input_mid_flight_leaves_other_requests_untouched(llm, tiny_llama):
    expected = [hf_greedy(tiny_llama, p, 12) for p in GOOD]
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in GOOD]
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="unknown token id"):
        engine.add_request([1, 99999], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1, 2], SamplingParams(max_tokens=0))
    finished = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
    assert [finished[i] for i in ids] == expected
    assert engine.stats().kv_blocks_used == 0


def test_one_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(GOOD + [[]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests


def test_unknown_engine_option_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="block_sizes"):
        LLM(str(tiny_llama), block_sizes=16)


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a local Hugging Face folder"):
        LLM(str(tmp_path / "nowhere"))
