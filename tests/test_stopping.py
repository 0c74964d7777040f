"""Requests end on stop strings, stop token ids, EOS and max_tokens, with the right reason."""

import pytest

from engine import LLM, SamplingParams
from tests.reference import hf_greedy

PROMPT = [10, 20, 30, 40, 50, 60]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_llama, request):
    # Asynchronous scheduling computes a token past a stop before it sees the stop: none
    # of it may leak into the output.
    return LLM(str(tiny_llama), num_kv_blocks=128, async_scheduling=request.param)


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return hf_greedy(tiny_llama, PROMPT, 24)


def test_max_tokens_ends_with_length(llm, expected):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == expected[:5] and out.finish_reason == "length"


def test_stop_token_id_ends_with_stop_and_names_the_token(llm, expected):
    stop_id = expected[3]
    first = expected.index(stop_id)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0]
    assert out.token_ids == expected[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_stop_string_truncates_the_text(llm, expected):
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = full.index(stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == full[:cut]
    assert len(out.token_ids) < 24
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True))[0]
    assert kept.text == full[:cut + len(stop)]


def test_the_stop_string_starting_earliest_in_the_text_wins(llm):
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].text
    # Two stop strings completed by the same token; the one listed first starts later.
    end = next(e for e in range(len(full) // 2, len(full) + 1)
               if full.find(full[e - 2:e]) == e - 2 and full.find(full[e - 5:e]) == e - 5)
    later, earlier = full[end - 2:end], full[end - 5:end]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                stop=[later, earlier]))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", earlier)
    assert out.text == full[:end - 5]


def test_eos_ends_with_stop_unless_ignored(llm, tiny_llama):
    eos = llm.tokenizer.eos_token_id
    prompts = [[i, i + 1, i + 2] for i in range(3, 300, 7)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    ended = [o for o in outs if o.token_ids and o.token_ids[-1] == eos]
    assert ended, "no prompt produced EOS within 40 tokens; pick other prompts"
    assert all(o.finish_reason == "stop" and o.stop_reason is None for o in ended)
    assert all(eos not in o.token_ids[:-1] for o in outs)
    ignored = llm.generate([ended[0].prompt_token_ids], SamplingParams(temperature=0, max_tokens=40,
                                                                       ignore_eos=True))[0]
    assert len(ignored.token_ids) == 40 and ignored.finish_reason == "length"


def test_streamed_text_concatenates_to_the_final_text(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["zzz-never"])
    pieces, tokens, last = [], [], None
    for out in llm.stream([PROMPT], params):
        pieces.append(out.new_text)
        tokens += out.new_token_ids
        last = out
    assert last.finished and "".join(pieces) == last.text and tokens == last.token_ids
