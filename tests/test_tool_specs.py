"""A request's tools and tool_choice: the checks that name a bad field, and how the
conversation tells the model about them (a template that renders tools, or the Hermes text)."""

import json

import pytest

from frontend.tool_parsers.hermes_tool_parser import HermesToolParser, parse_tool_calls
from frontend.tool_specs import ToolSpecError, prepare_conversation, template_supports_tools, validate_tools
from tests.tool_examples import CLOCK, NAMED_WEATHER, PARIS_CALL, WEATHER, default_tokenizer

HERMES = HermesToolParser()

# Written for these tests in the way Qwen2.5's template uses tools: it dumps each whole tool
# and each past call's arguments with tojson.
NATIVE_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


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
    messages, kwargs = prepare_conversation(past_conversation(), [WEATHER, CLOCK], native=False, parser=HERMES)
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
    messages, _ = prepare_conversation(past_conversation(system=None), [WEATHER], native=False, parser=HERMES)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("# Tools")
    assert [m["role"] for m in messages[1:]] == ["user", "assistant", "tool"]
    developer = [{"role": "developer", "content": [{"type": "text", "text": "Hi."}]}]
    messages, _ = prepare_conversation(developer, [WEATHER], native=False, parser=HERMES)
    assert len(messages) == 1 and messages[0]["content"][0] == {"type": "text", "text": "Hi."}
    assert "<tools>" in messages[0]["content"][1]["text"]


def test_without_tools_only_past_calls_and_results_are_converted():
    messages, kwargs = prepare_conversation(past_conversation(system=None), None, native=False, parser=HERMES)
    assert kwargs == {} and [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1] == {"role": "assistant", "content": PARIS_CALL}
    with_text = [{"role": "assistant", "content": "Checking.", "tool_calls": past_conversation()[2]["tool_calls"]}]
    messages, _ = prepare_conversation(with_text, [], native=False, parser=HERMES)
    assert messages[0]["content"] == "Checking.\n" + PARIS_CALL


def test_a_native_template_gets_the_tools_and_arguments_as_objects(tokenizer):
    messages, kwargs = prepare_conversation(past_conversation(), [WEATHER], native=True, parser=HERMES)
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
            prepare_conversation(messages, None, native=native, parser=HERMES)
        assert error.value.param == "messages[0].tool_calls[0].function"
