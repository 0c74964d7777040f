"""Incremental detokenization: equals a full decode, never splits a character or leaks a stop."""

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from tests.tiny_models import build_tokenizer

TEXTS = [
    "Caf\u00e9 na\u00efve \u00fcber",
    "\u65e5\u672c\u8a9e and emoji \U0001F600\U0001F600 mixed",
    "def fibonacci(n):\n    return n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer("Hello there").input_ids
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = []
    for token_id in ids:
        assert detok.add_token(token_id) is None
        delta = detok.take_delta(finished=False)
        assert "\ufffd" not in delta
        deltas.append(delta)
    detok.flush()
    deltas.append(detok.take_delta(finished=True))
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_byte_level_tokens_of_one_character_are_held_until_complete(tokenizer):
    # The emoji is four bytes; byte-level BPE may split it over several tokens.
    ids = tokenizer("\U0001F600").input_ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    seen = []
    for token_id in ids:
        detok.add_token(token_id)
        seen.append(detok.take_delta(finished=False))
    assert [s for s in seen if s] == ["\U0001F600"]


def test_stop_string_spanning_tokens_is_never_streamed(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["fox jumps"]))
    streamed, matched = "", None
    for token_id in ids:
        matched = detok.add_token(token_id)
        streamed += detok.take_delta(finished=matched is not None)
        if matched:
            break
    assert matched == "fox jumps"
    assert streamed == "The quick brown "
