"""Reading tool calls back: the Hermes parser on whole answers and streamed ones (the same
calls and content for any split), and the registry the handlers get it from."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.tool_parsers import ToolCallDelta, parser_for, tool_calls_json
from frontend.tool_parsers.hermes_tool_parser import HermesStreamingParser, parse_tool_calls
from tests.tool_examples import CALL_ID, PARIS_CALL


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
