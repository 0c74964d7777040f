"""The grammar that forces a call ("required" or a named function): what it admits, what
it refuses, and the default model decoding under it into a call that parses and validates."""

import json

import jsonschema
import pytest

from frontend.tool_call_grammar import tool_call_grammar
from frontend.tool_parsers.hermes_tool_parser import HermesToolParser, parse_tool_calls
from frontend.tool_specs import ToolSpecError, prepare_conversation
from tests.tool_examples import CLOCK, NAMED_WEATHER, PARIS_CALL, WEATHER, default_tokenizer

HERMES = HermesToolParser()


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(scope="module")
def grammar_compiler(tokenizer):
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152))


# --- the grammar of a forced call --------------------------------------------------------------

def matcher_for(grammar_compiler, ebnf: str):
    import xgrammar as xgr

    return xgr.GrammarMatcher(grammar_compiler.compile_grammar(ebnf))


def admits(grammar_compiler, ebnf: str, text: str) -> bool:
    """Whether the grammar takes text whole and then lets the model stop."""
    matcher = matcher_for(grammar_compiler, ebnf)
    return matcher.accept_string(text) and matcher.accept_token(matcher.stop_token_ids[0]) and matcher.is_terminated()


def test_no_grammar_when_the_model_may_choose():
    assert all(tool_call_grammar([WEATHER], choice, True, HERMES) is None for choice in (None, "auto", "none"))


@pytest.mark.parametrize("tool_choice, parallel", [(NAMED_WEATHER, False), ("required", False), ("required", True)])
def test_grammar_text_is_what_xgrammar_reads_back(tool_choice, parallel):
    import xgrammar as xgr

    ebnf = tool_call_grammar([WEATHER, CLOCK], tool_choice, parallel, HERMES)
    assert str(xgr.Grammar.from_ebnf(ebnf)) == ebnf


def test_a_named_choice_admits_one_call_of_that_tool_with_valid_arguments_only(grammar_compiler):
    ebnf = tool_call_grammar([WEATHER, CLOCK], NAMED_WEATHER, parallel_tool_calls=False, parser=HERMES)
    assert admits(grammar_compiler, ebnf, PARIS_CALL)
    named_clock = tool_call_grammar([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}}, False,
                                    HERMES)
    assert admits(grammar_compiler, named_clock, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "a\\"}b"}}\n</tool_call>')
    rejected = [
        PARIS_CALL.replace("get_weather", "get_time"),  # another tool
        PARIS_CALL.replace('"city": "Paris", ', ""),  # a required argument missing
        PARIS_CALL.replace("celsius", "kelvin"),  # outside the enum
        PARIS_CALL.replace('"celsius"}', '"celsius", "extra": 1}'),  # an argument the schema lacks
        PARIS_CALL.replace('{"city": ', '{ "city": '),  # free whitespace
        PARIS_CALL + "\n" + PARIS_CALL,  # a second call
        "Sure! " + PARIS_CALL,  # prose first
    ]
    assert [text for text in rejected if admits(grammar_compiler, ebnf, text)] == []
    assert not admits(grammar_compiler, ebnf, PARIS_CALL[:-1])


def test_required_admits_any_tool_and_parallel_calls_one_per_line(grammar_compiler):
    clock = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    single = tool_call_grammar([WEATHER, CLOCK], "required", parallel_tool_calls=False, parser=HERMES)
    parallel = tool_call_grammar([WEATHER, CLOCK], "required", parallel_tool_calls=True, parser=HERMES)
    assert admits(grammar_compiler, single, PARIS_CALL) and admits(grammar_compiler, single, clock)
    assert not admits(grammar_compiler, single, f"{PARIS_CALL}\n{clock}")
    assert admits(grammar_compiler, parallel, f"{PARIS_CALL}\n{clock}\n{PARIS_CALL}")
    assert not admits(grammar_compiler, parallel, f"{PARIS_CALL}{clock}")
    content, calls = parse_tool_calls(f"{PARIS_CALL}\n{clock}")
    assert content is None
    for call in calls:
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
        jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])


class BracketFormat(HermesToolParser):
    """Another way of writing calls (Hermes' reading of them kept: only the writing is under
    test): the grammar and the prompt text follow the parser's."""

    call_separator = " "

    def instructions(self, tools: list[dict]) -> str:
        return f"Call one of {len(tools)} tools as [CALL name]{{arguments}}[/CALL]."

    def call_opening(self, name: str) -> str:
        return f"[CALL {name}]"

    def call_closing(self) -> str:
        return "[/CALL]"


def test_the_grammar_writes_calls_as_the_servers_parser_does(grammar_compiler):
    brackets = BracketFormat()
    ebnf = tool_call_grammar([WEATHER, CLOCK], "required", parallel_tool_calls=True, parser=brackets)
    call = '[CALL get_weather]{"city": "Paris", "unit": "celsius"}[/CALL]'
    assert admits(grammar_compiler, ebnf, f"{call} {call}")
    assert not admits(grammar_compiler, ebnf, PARIS_CALL) and not admits(grammar_compiler, ebnf, f"{call}\n{call}")
    past = [{"role": "assistant", "content": "Checking both.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                            {"id": "c2", "type": "function",
                             "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]}]
    messages, _ = prepare_conversation(past, [WEATHER], native=False, parser=brackets)
    assert messages[0] == {"role": "system", "content": "Call one of 1 tools as [CALL name]{arguments}[/CALL]."}
    assert messages[-1]["content"] == ('Checking both.\n[CALL get_weather]{"city": "Paris"}[/CALL] '
                                       '[CALL get_time]{"tz": "CET"}[/CALL]')


def test_a_parameters_schema_xgrammar_cannot_enforce_is_an_error_naming_it():
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    with pytest.raises(ToolSpecError) as error:
        tool_call_grammar([WEATHER, broken], "required", False, HERMES)
    assert error.value.param == "tools[1].function.parameters"


def test_the_default_model_decoding_under_the_grammar_writes_a_valid_call(tokenizer, grammar_compiler):
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    from engine.checkpoint import ensure_default_model

    model = AutoModelForCausalLM.from_pretrained(ensure_default_model()).eval()
    messages, kwargs = prepare_conversation([{"role": "user", "content": "What is the weather in Paris?"}],
                                            [WEATHER, CLOCK], native=False, parser=HERMES)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                           **kwargs)
    matcher = matcher_for(grammar_compiler, tool_call_grammar([WEATHER, CLOCK], NAMED_WEATHER, False, HERMES))
    bitmask = xgr.allocate_token_bitmask(1, 49152)
    pieces, pending, cache, forwards = [], list(prompt), None, 0
    with torch.no_grad():
        while not matcher.is_terminated() and forwards < 40:
            # Text the grammar forces is fed in one go rather than decoded a token at a time.
            forced = matcher.find_jump_forward_string()
            if forced:
                assert matcher.accept_string(forced)
                pieces.append(forced)
                pending += tokenizer.encode(forced, add_special_tokens=False)
                continue
            output = model(input_ids=torch.tensor([pending]), past_key_values=cache, use_cache=True)
            cache, forwards = output.past_key_values, forwards + 1
            logits = output.logits[:, -1, :].float()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax(-1))
            assert matcher.accept_token(token)
            pending = [token]
            if token not in matcher.stop_token_ids:
                pieces.append(tokenizer.decode([token]))
    assert matcher.is_terminated()
    content, calls = parse_tool_calls("".join(pieces))
    assert content is None and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
