"""Sampling: seeded reproducibility, filters, penalties, logprobs, and parameter validation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams, protocol
from engine.input_processor import make_engine_request
from engine.sampling_params import MAX_STOP_STRING_LENGTH
from workers.sampler import SamplingRow, sample

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 130))]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=128)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].token_ids
    in_batch = llm.generate(PROMPTS, [params, SamplingParams(temperature=0.7, max_tokens=5),
                                      SamplingParams(temperature=0, max_tokens=9)])[0].token_ids
    assert alone == in_batch


def test_different_seeds_give_different_samples(llm):
    outs = llm.generate([PROMPTS[0]] * 4, [SamplingParams(temperature=1.5, seed=s, max_tokens=16, ignore_eos=True)
                                           for s in range(4)])
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_seeded_sampling_survives_preemption(tiny_llama):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    roomy = LLM(str(tiny_llama), num_kv_blocks=128).generate(PROMPTS, params)
    tight_llm = LLM(str(tiny_llama), num_kv_blocks=16, block_size=4)
    tight = tight_llm.generate(PROMPTS, params)
    assert tight_llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    top_k = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True))
    top_p = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in top_k] == [o.token_ids for o in greedy]
    assert [o.token_ids for o in top_p] == [o.token_ids for o in greedy]


def test_top_k_keeps_samples_inside_the_top_k():
    logits = torch.tensor([[0.0, 5.0, 4.9, 4.8, -1.0, 3.0]]).repeat(200, 1)
    rows = [SamplingRow(SamplingParams(temperature=5.0, top_k=2, seed=i), [], []) for i in range(200)]
    tokens, _ = sample(logits, rows)
    assert set(tokens) == {1, 2}


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([[10.0, 9.5, 0.0, 0.0, 0.0]]).repeat(200, 1)
    rows = [SamplingRow(SamplingParams(temperature=1.0, min_p=0.1, seed=i), [], []) for i in range(200)]
    tokens, _ = sample(logits, rows)
    assert set(tokens) == {0, 1}


def test_repetition_and_frequency_penalties_change_the_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain, _ = sample(logits, [SamplingRow(SamplingParams(temperature=0), [0], [])])
    repeated, _ = sample(logits, [SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.5), [0], [])])
    frequent, _ = sample(logits, [SamplingRow(SamplingParams(temperature=0, frequency_penalty=0.5), [], [0])])
    present, _ = sample(logits, [SamplingRow(SamplingParams(temperature=0, presence_penalty=0.5), [], [0])])
    assert plain == [0] and repeated == [1] and frequent == [1] and present == [1]


def test_logprobs_return_the_top_n_and_the_sampled_token(llm):
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert len(entry.top) == 3
        assert entry.top[0][0] == token_id  # greedy picks the most likely
        assert entry.sampled_logprob == pytest.approx(entry.top[0][1])
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 2.0),
    ("max_tokens", 0), ("logprobs", 1025), ("logit_bias", {5: 101.0}), ("logit_bias", {-1: 1.0}),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("stop", [""]), ("stop_token_ids", [-1]),
    ("max_tokens", "5"), ("temperature", "hot"), ("seed", 1.5), ("top_k", True), ("stop", 3),
    # Values msgpack or torch cannot carry, which used to pass and fail after registration.
    ("seed", 2**64), ("seed", -(2**63) - 1), ("top_k", 2**64), ("top_k", 2**31), ("max_tokens", 2**31),
    ("max_tokens", 2**64), ("logprobs", 2**64), ("stop_token_ids", [2**64]), ("stop_token_ids", [True]),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", 10**400), ("top_p", math.nan),
    ("min_p", math.nan), ("repetition_penalty", math.inf), ("presence_penalty", math.nan),
    ("frequency_penalty", -math.inf), ("ignore_eos", "yes"), ("skip_special_tokens", None),
    # A long stop string holds back that much streamed text and is searched for per token.
    ("stop", ["x" * (MAX_STOP_STRING_LENGTH + 1)]), ("stop", ["ok", "é" * (MAX_STOP_STRING_LENGTH + 1)]),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field}="):
        SamplingParams(**{field: value})


def test_extreme_valid_values_are_kept():
    params = SamplingParams(seed=2**64 - 1, top_k=2**31 - 1, max_tokens=2**31 - 1, stop_token_ids=[2**31 - 1])
    assert (params.seed, params.top_k) == (2**64 - 1, 2**31 - 1)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(stop=["x" * MAX_STOP_STRING_LENGTH]).stop == ["x" * MAX_STOP_STRING_LENGTH]


def test_an_error_does_not_echo_a_huge_value_back():
    with pytest.raises(ValueError, match="stop=") as refused:
        SamplingParams(stop=["x" * 1_000_000])
    assert len(str(refused.value)) < 300


# Values around every bound (and far past them), numbers msgpack or torch cannot carry included.
INTS = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70),
                 st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]))
NUMBERS = st.one_of(st.floats(-3.0, 3.0), st.floats(allow_nan=True, allow_infinity=True), INTS,
                    st.sampled_from([10**400, -(10**400)]))
# A few fields at a time, so accepted sets are common enough to test what follows acceptance.
SAMPLING_FIELDS = st.fixed_dictionaries({}, optional={
    "temperature": NUMBERS, "top_p": NUMBERS, "top_k": INTS, "min_p": NUMBERS,
    "seed": st.one_of(st.none(), INTS), "max_tokens": INTS, "logprobs": st.one_of(st.none(), INTS),
    "stop_token_ids": st.lists(INTS, max_size=3), "repetition_penalty": NUMBERS,
    "presence_penalty": NUMBERS, "frequency_penalty": NUMBERS,
})


@settings(max_examples=400, deadline=None)
@given(SAMPLING_FIELDS)
def test_every_accepted_sampling_params_encodes_and_samples(fields):
    try:
        params = SamplingParams(**fields)
    except ValueError:
        return
    message = make_engine_request("r", [1, 2], params, [0], max_model_len=2**40)
    assert protocol.decode_input(protocol.encode(message)) == message
    tokens, _ = sample(torch.zeros(1, 8), [SamplingRow(params, [1, 2], [3])])
    assert 0 <= tokens[0] < 8


def test_sampler_makes_every_tensor_on_the_logits_device():
    """On a GPU a CPU-made mask, generator or penalty tensor beside CUDA logits crashes the
    decoder at the first non-greedy request. Here any tensor the sampler makes without naming
    the logits' device lands on the meta device, and mixing it with the CPU logits raises."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    everything = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3, repetition_penalty=1.2,
                                presence_penalty=0.5, frequency_penalty=0.3, logit_bias={1: 2.0}, logprobs=2)
    rows = [SamplingRow(everything, [1, 2], [3]), SamplingRow(SamplingParams(temperature=0), [1], []),
            SamplingRow(SamplingParams(temperature=1.0, seed=4), [1], [])]
    expected = sample(logits.clone(), rows)
    with torch.device("meta"):
        tokens, logprobs = sample(logits.clone(), rows)
    assert (tokens, logprobs) == expected
    assert tokens[1] == int(logits[1].argmax())
