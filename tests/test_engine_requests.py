"""One way to build a request: EOS ids from the checkpoint's files, the wire struct with
max_tokens capped to the context, and the scheduler's Request made from that struct."""

import json

import pytest

from engine import protocol
from engine.checkpoint import eos_token_ids, load_tokenizer
from engine.input_processor import make_engine_request, to_request
from engine.sampling_params import SamplingParams


def test_eos_ids_are_the_union_of_generation_config_config_and_tokenizer(tiny_multi_eos):
    tokenizer = load_tokenizer(tiny_multi_eos)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_token_id == endoftext
    assert eos_token_ids(tiny_multi_eos, tokenizer) == tuple(sorted((im_end, endoftext)))


def test_eos_ids_read_a_nested_text_config_and_need_no_generation_config(tmp_path, tiny_llama):
    tokenizer = load_tokenizer(tiny_llama)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {"eos_token_id": [7, 9]}}))
    assert eos_token_ids(tmp_path, tokenizer) == tuple(sorted({7, 9, tokenizer.eos_token_id}))


def test_engine_request_caps_max_tokens_to_what_the_context_leaves():
    params = SamplingParams(max_tokens=100, stop=["x"])
    message = make_engine_request("r1", [1, 2, 3], params, (5, 6), max_model_len=10, cache_salt="tenant")
    assert message.sampling_params.max_tokens == 7
    assert message.sampling_params.stop == ["x"] and params.max_tokens == 100
    assert (message.eos_token_ids, message.cache_salt) == ([5, 6], "tenant")
    # It survives the wire, and the decoder side builds the same Request as the offline side.
    request = to_request(protocol.decode_input(protocol.encode(message)))
    assert (request.request_id, request.prompt_token_ids, request.eos_token_ids, request.cache_salt) == (
        "r1", [1, 2, 3], (5, 6), "tenant")
    assert request.sampling_params == message.sampling_params


@pytest.mark.parametrize("prompt,message", [([], "prompt_token_ids is empty"),
                                            (list(range(10)), "longer than the context")])
def test_engine_request_refuses_a_prompt_with_no_room_for_output(prompt, message):
    with pytest.raises(ValueError, match=message):
        make_engine_request("r", prompt, SamplingParams(), (), max_model_len=10)
