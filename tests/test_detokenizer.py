"""Output processing: incremental text equals a full decode, never splits a character, never
leaks a stop string, and the stop string that starts earliest in the text wins."""

import pytest

from engine.output_processor import RequestOutputProcessor
from engine.sampling_params import SamplingParams
from tests.tiny_models import build_tokenizer

TEXTS = [
    "Caf\u00e9 na\u00efve \u00fcber",
    "\u65e5\u672c\u8a9e and emoji \U0001F600\U0001F600 mixed",
    "def fibonacci(n):\n    return n",
]
FOX = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def run_token_by_token(processor, ids, finish_reason="length"):
    """Feed one token per update, the last with the engine's finish reason; returns the updates."""
    updates = []
    for index, token_id in enumerate(ids):
        updates.append(processor.update([token_id], finish_reason if index == len(ids) - 1 else None, None))
        if updates[-1].finished:
            break
    return updates


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer("Hello there").input_ids
    ids = tokenizer(text).input_ids
    updates = run_token_by_token(RequestOutputProcessor(tokenizer, prompt, SamplingParams()), ids)
    assert all("\ufffd" not in u.text for u in updates)
    assert "".join(u.text for u in updates) == tokenizer.decode(ids) == text
    assert [t for u in updates for t in u.token_ids] == ids


def test_byte_level_tokens_of_one_character_are_held_until_complete(tokenizer):
    ids = tokenizer("\U0001F600").input_ids
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    updates = run_token_by_token(RequestOutputProcessor(tokenizer, [], SamplingParams()), ids + ids, None)
    assert [u.text for u in updates if u.text] == ["\U0001F600", "\U0001F600"]


def test_a_request_ending_inside_a_character_ends_like_a_full_decode(tokenizer):
    ids = tokenizer("ok \U0001F600").input_ids[:-1]
    updates = run_token_by_token(RequestOutputProcessor(tokenizer, [], SamplingParams()), ids)
    assert "".join(u.text for u in updates) == tokenizer.decode(ids)
    assert updates[-1].text.endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_unless_asked_for(tokenizer, skip):
    ids = tokenizer("done<|im_end|> after").input_ids
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    updates = run_token_by_token(RequestOutputProcessor(tokenizer, [], SamplingParams(skip_special_tokens=skip)), ids)
    text = "".join(u.text for u in updates)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


def test_stop_string_spanning_tokens_is_never_streamed(tokenizer):
    processor = RequestOutputProcessor(tokenizer, [], SamplingParams(stop=["fox jumps"]))
    updates = run_token_by_token(processor, tokenizer(FOX).input_ids, None)
    last = updates[-1]
    assert (last.finish_reason, last.stop_reason, last.stopped_by_string) == ("stop", "fox jumps", True)
    assert "".join(u.text for u in updates) == "The quick brown "


def test_the_stop_string_starting_earliest_in_the_text_wins_over_list_order(tokenizer):
    # Both complete with the token " fox" ends on; "brown fox" starts first in the text.
    processor = RequestOutputProcessor(tokenizer, [], SamplingParams(stop=["fox", "brown fox"]))
    updates = run_token_by_token(processor, tokenizer(FOX).input_ids, None)
    assert updates[-1].stop_reason == "brown fox"
    assert "".join(u.text for u in updates) == "The quick "


def test_tokens_after_the_stop_are_not_consumed(tokenizer):
    ids = tokenizer(FOX).input_ids
    processor = RequestOutputProcessor(tokenizer, [], SamplingParams(stop=["fox"], include_stop_str_in_output=True))
    update = processor.update(ids, None, None)  # one update carrying the whole text
    stop_token = next(i for i in range(len(ids)) if "fox" in tokenizer.decode(ids[:i + 1]))
    assert update.token_ids == ids[:stop_token + 1]
    assert (update.text, update.finish_reason, update.stop_reason) == ("The quick brown fox", "stop", "fox")
    with pytest.raises(RuntimeError, match="already finished"):
        processor.update([1], None, None)


def test_text_held_back_for_a_stop_string_is_released_when_the_request_ends(tokenizer):
    ids = tokenizer(FOX).input_ids
    processor = RequestOutputProcessor(tokenizer, [], SamplingParams(stop=["never here"]))
    streamed = ""
    for index, token_id in enumerate(ids[:-1]):
        streamed += processor.update([token_id], None, None).text
        # Never more than len("never here") - 1 characters behind the decoded text.
        decoded = tokenizer.decode(ids[:index + 1])
        assert decoded.startswith(streamed) and len(decoded) - len(streamed) <= len("never here") - 1
    last = processor.update([ids[-1]], "length", None)
    assert (last.finish_reason, last.stop_reason, last.stopped_by_string) == ("length", None, False)
    assert streamed + last.text == FOX


def test_the_engines_finish_reason_passes_through(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    processor = RequestOutputProcessor(tokenizer, [], SamplingParams(stop_token_ids=[eos]))
    update = processor.update(tokenizer("Hi").input_ids + [eos], "stop", eos)
    assert (update.text, update.finish_reason, update.stop_reason, update.stopped_by_string) == ("Hi", "stop", eos,
                                                                                             False)

