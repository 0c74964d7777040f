"""Tool calling in the Hermes/Qwen format: request checks, prompts, parsing whole and streamed
answers, and the grammar that forces a call, down to a real model decoding under it."""

import itertools
import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.tool_call_grammar import tool_call_grammar
from frontend.tool_parsers import ToolCallDelta, parser_for, tool_calls_json
from frontend.tool_parsers.hermes_tool_parser import HermesStreamingParser, parse_tool_calls
from frontend.tool_specs import ToolSpecError, prepare_conversation, template_supports_tools, validate_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
# Written for these tests in the way Qwen2.5's template uses tools: it dumps each whole tool
# and each past call's arguments with tojson.
NATIVE_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer():
    from engine.checkpoint import ensure_default_model, load_tokenizer

    return load_tokenizer(ensure_default_model())


@pytest.fixture(scope="module")
def grammar_compiler(tokenizer):
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152))


# --- validate_tools ---------------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required", NAMED_WEATHER])
def test_well_formed_tools_pass_with_every_tool_choice(tool_choice):
    bare = {"type": "function", "function": {"name": "ping-2_x", "strict": True}}
    validate_tools([WEATHER, CLOCK, bare], tool_choice)


@pytest.mark.parametrize("tools, param", [
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([WEATHER, {"type": "function", "function": {"name": "bad name"}}], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f\n"}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict"),
])
def test_a_bad_tool_is_an_error_naming_its_field(tools, param):
    with pytest.raises(ToolSpecError) as error:
        validate_tools(tools, None)
    assert error.value.param == param


@pytest.mark.parametrize("tools, tool_choice", [
    ([WEATHER], "always"),
    ([WEATHER], {"type": "function"}),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}),
    ([], "required"),
    (None, NAMED_WEATHER),
])
def test_a_tool_choice_that_cannot_be_met_is_an_error_on_tool_choice(tools, tool_choice):
    with pytest.raises(ToolSpecError) as error:
        validate_tools(tools, tool_choice)
    assert error.value.param == "tool_choice"


# --- the chat template and the conversation ----------------------------------------------------

def test_default_model_template_ignores_tools_and_a_qwen_style_one_renders_them(tokenizer):
    assert not template_supports_tools(tokenizer.chat_template)
    assert template_supports_tools(NATIVE_TEMPLATE)
    assert not template_supports_tools("{{ 'I have no tools' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_supports_tools(None)
    # A tag only transformers knows stops Jinja's parser; the word itself must then decide.
    assert template_supports_tools("{% generation %}{{ tools | tojson }}{% endgeneration %}")
    assert not template_supports_tools("{% generation %}{{ messages }}{% endgeneration %}")


def past_conversation(system: str | None = "Be brief.") -> list[dict]:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    return ([{"role": "system", "content": system}] if system is not None else []) + messages


def test_a_plain_template_gets_tools_calls_and_results_written_as_text(tokenizer):
    messages, kwargs = prepare_conversation(past_conversation(), [WEATHER, CLOCK], native=False)
    assert kwargs == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert all(isinstance(m["content"], str) for m in messages)
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [WEATHER, CLOCK]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert messages[2]["content"] == PARIS_CALL
    assert messages[3]["content"] == "<tool_response>\n18 degrees\n</tool_response>"
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert f"<|im_start|>assistant\n{PARIS_CALL}<|im_end|>" in rendered
    assert "<|im_start|>tool\n<tool_response>\n18 degrees\n</tool_response><|im_end|>" in rendered
    # What the model is shown as a past call is what the parser reads as one.
    content, calls = parse_tool_calls(messages[2]["content"])
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_tool_instructions_open_the_conversation_when_it_has_no_system_message():
    messages, _ = prepare_conversation(past_conversation(system=None), [WEATHER], native=False)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("# Tools")
    assert [m["role"] for m in messages[1:]] == ["user", "assistant", "tool"]
    developer = [{"role": "developer", "content": [{"type": "text", "text": "Hi."}]}]
    messages, _ = prepare_conversation(developer, [WEATHER], native=False)
    assert len(messages) == 1 and messages[0]["content"][0] == {"type": "text", "text": "Hi."}
    assert "<tools>" in messages[0]["content"][1]["text"]


def test_without_tools_only_past_calls_and_results_are_converted():
    messages, kwargs = prepare_conversation(past_conversation(system=None), None, native=False)
    assert kwargs == {} and [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1] == {"role": "assistant", "content": PARIS_CALL}
    with_text = [{"role": "assistant", "content": "Checking.", "tool_calls": past_conversation()[2]["tool_calls"]}]
    assert prepare_conversation(with_text, [], native=False)[0][0]["content"] == "Checking.\n" + PARIS_CALL


def test_a_native_template_gets_the_tools_and_arguments_as_objects(tokenizer):
    messages, kwargs = prepare_conversation(past_conversation(), [WEATHER], native=True)
    assert kwargs == {"tools": [WEATHER]}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert messages[2]["content"] == "" and messages[3]["tool_call_id"] == "call_1"
    rendered = tokenizer.apply_chat_template(messages, chat_template=NATIVE_TEMPLATE, tokenize=False, **kwargs)
    assert json.loads(rendered.split("<tools>")[1].split("</tools>")[0]) == WEATHER
    assert '"arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>' in rendered


def test_a_past_call_without_a_function_name_is_an_error_naming_it():
    messages = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]
    for native in (True, False):
        with pytest.raises(ToolSpecError) as error:
            prepare_conversation(messages, None, native=native)
        assert error.value.param == "messages[0].tool_calls[0].function"


# --- parsing a whole answer --------------------------------------------------------------------

def test_calls_come_out_in_order_with_arguments_as_written_and_prose_as_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":  "Pa\\"ris}"}}\n'
            '</tool_call>\nand\n<tool_call>{"name":"get_time","arguments":{"tz":"CET","x":[1,{"y":2}]}}</tool_call>\n')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.\n\nand"
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":  "Pa\\"ris}"}'), ("get_time", '{"tz":"CET","x":[1,{"y":2}]}')]
    assert all(CALL_ID.fullmatch(c.id) for c in calls) and calls[0].id != calls[1].id
    assert tool_calls_json(calls) == [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                    "arguments": c.arguments}}
                                      for c in calls]


def test_the_default_parser_is_hermes_whole_and_streamed_and_an_unknown_name_is_refused():
    parser = parser_for()
    content, calls = parser.parse("Sure. " + PARIS_CALL)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    stream = parser.streaming()
    pieces = stream.feed("Sure. " + PARIS_CALL[:30]) + stream.feed(PARIS_CALL[30:]) + stream.finish()
    assert pieces[0] == "Sure. " and all(isinstance(p, ToolCallDelta) for p in pieces[1:])
    assert pieces[1].name == "get_weather" and CALL_ID.fullmatch(pieces[1].id)
    assert "".join(p.arguments for p in pieces[1:]) == '{"city": "Paris", "unit": "celsius"}'
    with pytest.raises(ValueError, match="no tool parser named 'mistral'"):
        parser_for("mistral")


def test_an_answer_without_calls_comes_back_unchanged():
    assert parse_tool_calls("  Hello <tool there\n") == ("  Hello <tool there\n", [])
    assert parse_tool_calls(PARIS_CALL)[0] is None


@pytest.mark.parametrize("block", [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": 5}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "not an object"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
    '<tool_call>{"name": "f"}</tool_call>',
    '<tool_call>{"name": "f" "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {}, "name": "f"} trailing</tool_call>',
    '<tool_call>{"arguments": {}, "name": "f"}',
])
def test_a_block_that_is_not_a_call_stays_content(block):
    text = f"Before {block} after"
    assert parse_tool_calls(text) == (text, [])
    assert streamed(text, [len(text) // 3, len(text) // 2]) == ([], [], text)


def test_arguments_written_as_a_json_string_are_the_object_text_it_holds():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"q\\": \\"a b\\"}"}\n</tool_call>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(text)[1]] == [("f", '{"q": "a b"}')]
    reordered = '<tool_call>{"arguments": {"q" :1}, "name": "f"}</tool_call>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(reordered)[1]] == [("f", '{"q" :1}')]


def test_a_call_whose_header_is_complete_keeps_what_the_model_wrote_even_if_broken_later():
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"note": "</tool_call> is text", "n": [1'
    content, calls = parse_tool_calls(text)
    assert content == "Hi" and [(c.name, c.arguments) for c in calls] == [
        ("f", '{"note": "</tool_call> is text", "n": [1')]
    # The rest of a block after its arguments is dropped, whatever it is.
    text = '<tool_call>{"name": "f", "arguments": {"a": 1} oops</tool_call> after'
    assert [(c.name, c.arguments) for c in parse_tool_calls(text)[1]] == [("f", '{"a": 1}')]
    assert parse_tool_calls(text)[0] == "after"
    assert streamed(text, [30, 40]) == (["f"], ['{"a": 1}'], " after")


def test_a_block_left_open_ends_where_the_next_call_begins():
    text = ('<tool_call>{"name": "a", "arguments": {}}<tool_call>oops<tool_call>'
            '{"arguments": {}, "name": "b"}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["a", "b"] and content == "<tool_call>oops"


# --- streaming ---------------------------------------------------------------------------------

def streamed(text: str, cuts: list[int]) -> tuple[list[str], list[str], str]:
    """(names, arguments, content) as a client puts them together from the streamed deltas."""
    parser, items = HermesStreamingParser(), []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for start, end in itertools.pairwise(bounds):
        items += parser.feed(text[start:end])
    items += parser.finish()
    names, arguments, content = [], [], ""
    for item in items:
        if isinstance(item, str):
            assert item, "an empty content delta"
            content += item
        elif item.id is not None:
            assert item.index == len(names) and CALL_ID.fullmatch(item.id) and item.name
            names.append(item.name)
            arguments.append(item.arguments)
        else:
            assert item.index == len(names) - 1 and item.name is None and item.arguments
            arguments[-1] += item.arguments
    return names, arguments, content


def test_arguments_stream_while_the_model_writes_them():
    parser = HermesStreamingParser()
    assert parser.feed("Sure. <tool_ca") == ["Sure. "]
    first = parser.feed('ll>\n{"name": "get_weather", "arguments": {"city": "Pa\\"r')
    assert len(first) == 1 and first[0].name == "get_weather" and CALL_ID.fullmatch(first[0].id)
    assert first[0].arguments == '{"city": "Pa\\"r'
    assert parser.feed('is", "unit": "cel') == [ToolCallDelta(0, None, None, 'is", "unit": "cel')]
    assert parser.feed('sius"}}\n</tool_call>\nDone') == [ToolCallDelta(0, None, None, 'sius"}'), "\nDone"]
    assert parser.finish() == []


def test_text_that_might_open_a_call_is_held_back_until_it_cannot():
    parser = HermesStreamingParser()
    assert parser.feed("a <tool") == ["a "]
    assert parser.feed("box>") == ["<toolbox>"]
    assert parser.feed(" ends <tool_call") == [" ends "]
    assert parser.finish() == ["<tool_call"]


def test_a_block_that_turns_out_not_to_be_a_call_is_given_out_as_content_when_it_ends():
    parser = HermesStreamingParser()
    assert parser.feed("<tool_call>\n{not json") == []
    assert parser.feed("}\n</tool_call> then") == ["<tool_call>\n{not json}\n</tool_call> then"]
    assert parser.feed('<tool_call>{"name": 1}') == []
    assert parser.finish() == ['<tool_call>{"name": 1}']


TRICKY = 'ab {}[]"\\<>/\n:,é'
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-99, 99) | st.text(TRICKY, max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(TRICKY, max_size=4), inner, max_size=3),
    max_leaves=6)
argument_objects = st.dictionaries(st.text(TRICKY, max_size=4), json_values, max_size=3)
tool_names = st.from_regex(r"[a-zA-Z0-9_-]{1,8}", fullmatch=True)
prose = st.text(TRICKY + "tol_c", max_size=12).filter(lambda s: "<tool_call>" not in s)


@st.composite
def well_formed_call(draw) -> tuple[str, str, dict]:
    """(block text, name, arguments) in one of the ways a model writes a whole call."""
    name, arguments = draw(tool_names), draw(argument_objects)
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" ,  ", " : ")]))
    arguments_text = json.dumps(arguments, separators=separators, ensure_ascii=draw(st.booleans()))
    form = draw(st.sampled_from(["streamable", "string", "arguments_first"]))
    if form == "streamable":
        body = f'{{"name": "{name}", "arguments": {arguments_text}}}'
    elif form == "string":
        body = json.dumps({"name": name, "arguments": arguments_text})
    else:
        body = f'{{"arguments": {arguments_text}, "name": "{name}"}}'
    return f"<tool_call>{draw(st.sampled_from(['', chr(10), ' ']))}{body}\n</tool_call>", name, arguments


@st.composite
def answer_pieces(draw) -> str:
    """Prose, calls, calls broken off anywhere, and stray tags, in any order."""
    pieces = []
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["prose", "call", "broken", "tag"]))
        if kind == "prose":
            pieces.append(draw(prose))
        elif kind == "call":
            pieces.append(draw(well_formed_call())[0])
        elif kind == "broken":
            block = draw(well_formed_call())[0]
            pieces.append(block[:draw(st.integers(0, len(block)))])
        else:
            pieces.append(draw(st.sampled_from(["<tool_call>", "</tool_call>", "<tool_c", "<", '{"name": "f"'])))
    return "".join(pieces)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_streamed_calls_and_content_equal_the_whole_answer_parsed_for_any_split(data):
    text = data.draw(answer_pieces())
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    content, calls = parse_tool_calls(text)
    for split in (cuts, range(len(text))):  # random pieces, then one character at a time
        names, arguments, streamed_content = streamed(text, list(split))
        assert names == [c.name for c in calls]
        assert arguments == [c.arguments for c in calls]
        assert streamed_content.strip() == (content or "").strip()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(prose, well_formed_call()), max_size=4), prose)
def test_every_well_formed_call_is_found_with_its_arguments_and_the_prose_is_the_content(pairs, last):
    text = "".join(before + block for before, (block, _, _) in pairs) + last
    content, calls = parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args) for _, (_, name, args) in pairs]
    words = "".join(before for before, _ in pairs) + last
    assert content == ((words.strip() or None) if pairs else text)


# --- the grammar of a forced call --------------------------------------------------------------

def matcher_for(grammar_compiler, ebnf: str):
    import xgrammar as xgr

    return xgr.GrammarMatcher(grammar_compiler.compile_grammar(ebnf))


def admits(grammar_compiler, ebnf: str, text: str) -> bool:
    """Whether the grammar takes text whole and then lets the model stop."""
    matcher = matcher_for(grammar_compiler, ebnf)
    return matcher.accept_string(text) and matcher.accept_token(matcher.stop_token_ids[0]) and matcher.is_terminated()


def test_no_grammar_when_the_model_may_choose():
    assert all(tool_call_grammar([WEATHER], choice, True) is None for choice in (None, "auto", "none"))


@pytest.mark.parametrize("tool_choice, parallel", [(NAMED_WEATHER, False), ("required", False), ("required", True)])
def test_grammar_text_is_what_xgrammar_reads_back(tool_choice, parallel):
    import xgrammar as xgr

    ebnf = tool_call_grammar([WEATHER, CLOCK], tool_choice, parallel)
    assert str(xgr.Grammar.from_ebnf(ebnf)) == ebnf


def test_a_named_choice_admits_one_call_of_that_tool_with_valid_arguments_only(grammar_compiler):
    ebnf = tool_call_grammar([WEATHER, CLOCK], NAMED_WEATHER, parallel_tool_calls=False)
    assert admits(grammar_compiler, ebnf, PARIS_CALL)
    named_clock = tool_call_grammar([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}}, False)
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
    single = tool_call_grammar([WEATHER, CLOCK], "required", parallel_tool_calls=False)
    parallel = tool_call_grammar([WEATHER, CLOCK], "required", parallel_tool_calls=True)
    assert admits(grammar_compiler, single, PARIS_CALL) and admits(grammar_compiler, single, clock)
    assert not admits(grammar_compiler, single, f"{PARIS_CALL}\n{clock}")
    assert admits(grammar_compiler, parallel, f"{PARIS_CALL}\n{clock}\n{PARIS_CALL}")
    assert not admits(grammar_compiler, parallel, f"{PARIS_CALL}{clock}")
    content, calls = parse_tool_calls(f"{PARIS_CALL}\n{clock}")
    assert content is None
    for call in calls:
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
        jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])


def test_a_parameters_schema_xgrammar_cannot_enforce_is_an_error_naming_it():
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    with pytest.raises(ToolSpecError) as error:
        tool_call_grammar([WEATHER, broken], "required", False)
    assert error.value.param == "tools[1].function.parameters"


def test_the_default_model_decoding_under_the_grammar_writes_a_valid_call(tokenizer, grammar_compiler):
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    from engine.checkpoint import ensure_default_model

    model = AutoModelForCausalLM.from_pretrained(ensure_default_model()).eval()
    messages, kwargs = prepare_conversation([{"role": "user", "content": "What is the weather in Paris?"}],
                                            [WEATHER, CLOCK], native=False)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                           **kwargs)
    matcher = matcher_for(grammar_compiler, tool_call_grammar([WEATHER, CLOCK], NAMED_WEATHER, False))
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

