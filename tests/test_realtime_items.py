"""What a client may add to a Realtime conversation: a function_call_output answers a call the
conversation holds, once; no item takes the name of the conversation's start ("root") or an id
the server announced for an answer; and a conversation past the prompt limit is refused from
counts kept per item, without templating it again."""

import asyncio
from types import SimpleNamespace

import pytest

from frontend.edge_decoding import InvalidInput
from engine.checkpoint import DEFAULT_MODEL_NAME, cache_dir, load_tokenizer
from engine.token_floor import TokenFloor
from frontend.realtime_conversation import EDGE_TOKENS, item_text, least_tokens
from frontend.realtime_events import ItemCreate, ItemDelete, MessageItem, ResponseCreate, ResponseOptions
from frontend.realtime_tools import conversation_messages
from tests.test_realtime_closing import WordTokenizer, scripted_session, settle, user_item


def call(call_id: str, item_id: str | None = None) -> ItemCreate:
    return ItemCreate(item=MessageItem(type="function_call", call_id=call_id, name="get_weather",
                                       arguments='{"city": "Paris"}', id=item_id))


def output(call_id: str, previous: str | None = None) -> ItemCreate:
    return ItemCreate(item=MessageItem(type="function_call_output", call_id=call_id, output='{"sky": "blue"}'),
                      previous_item_id=previous)


async def refused(coroutine) -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        await asyncio.wait_for(coroutine, 5)
    return info.value


async def test_a_function_call_output_needs_an_earlier_call_of_its_id_and_only_one_output():
    session, ws, _ = scripted_session()
    error = await refused(session.on_item_create(output("call_unknown")))
    assert (error.code, error.param) == ("invalid_call_id", "item.call_id")

    await session.on_item_create(call("call_1", "the_call"))
    await session.on_item_create(output("call_1"))
    error = await refused(session.on_item_create(output("call_1")))
    assert error.code == "invalid_call_id" and "already has an output" in str(error)
    error = await refused(session.on_item_create(call("call_1")))
    assert error.code == "invalid_call_id"
    # An output placed before its call answers nothing.
    await session.on_item_create(call("call_2"))
    error = await refused(session.on_item_create(output("call_2", previous="root")))
    assert error.code == "invalid_call_id"
    assert [item["type"] for item in session.items.values()] == ["function_call", "function_call_output",
                                                                 "function_call"]


async def test_an_out_of_band_input_answers_only_its_own_calls():
    session, ws, generation = scripted_session()
    options = ResponseOptions(conversation="none", input=[
        MessageItem(type="function_call_output", call_id="call_9", output="{}")])
    error = await refused(session.on_response_create(ResponseCreate(response=options)))
    assert (error.code, error.param) == ("invalid_call_id", "response.input.call_id")
    options = ResponseOptions(conversation="none", input=[
        MessageItem(type="function_call", call_id="call_9", name="f", arguments="{}"),
        MessageItem(type="function_call_output", call_id="call_9", output="{}")])
    await session.on_response_create(ResponseCreate(response=options))
    await settle(session)
    assert ws.events[-1]["response"]["status"] == "completed"


async def test_root_is_the_start_of_the_conversation_never_an_item_id():
    session, ws, _ = scripted_session()
    await session.on_item_create(user_item("first", "a"))
    error = await refused(session.on_item_create(user_item("named root", "root")))
    assert (error.code, error.param) == ("invalid_value", "item.id")
    await session.on_item_create(ItemCreate(item=user_item("before a", "b").item, previous_item_id="root"))
    assert list(session.items) == ["b", "a"]


async def test_a_client_item_cannot_take_the_id_of_an_answer_still_being_written():
    session, ws, _ = scripted_session()
    await session.on_item_create(user_item("hi", "question"))
    reached, release = ws.hold("response.content_part.added")
    await session.on_response_create(ResponseCreate())
    await asyncio.wait_for(reached.wait(), 5)
    answer_id = next(e for e in ws.events if e["type"] == "response.output_item.added")["item"]["id"]

    try:
        error = await refused(session.on_item_create(user_item("squatting", answer_id)))
        assert (error.code, error.param) == ("duplicate_item_id", "item.id")
    finally:
        release.set()
    await settle(session)
    assert list(session.items) == ["question", answer_id]
    assert session.conversation_bytes == len("hi") + len("Hello there") and not session.announced_ids


class CountingTokenizer(WordTokenizer):
    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, texts, add_special_tokens=True):
        self.texts += texts
        return super().__call__(texts, add_special_tokens)


async def test_a_conversation_past_the_prompt_limit_is_refused_before_templating_and_counted_once():
    session, ws, generation = scripted_session()
    templated = []
    generation.tokenizer, generation.max_prompt_tokens = CountingTokenizer(), 20

    async def chat_prompt(messages, tools=None):
        templated.append(messages)
        return [1, 2, 3]

    generation.chat_prompt = chat_prompt
    for n in range(3):
        await session.on_item_create(user_item(" ".join(["word"] * 10), f"item{n}"))  # 10 tokens each
    for _ in range(3):
        error = await refused(session.on_response_create(ResponseCreate()))
        assert error.code == "prompt_too_long" and "at least 24 tokens" in str(error)  # (10 - 2) * 3
    assert templated == [] and generation.admission.held == 0
    assert len(generation.tokenizer.texts) == 3  # each item counted once, not once per response.create

    await session.on_item_create(user_item("one more", "item3"))
    await refused(session.on_response_create(ResponseCreate()))
    assert generation.tokenizer.texts[3:] == ["one more"]
    # Under the limit the conversation is templated as before.
    for n in range(3):
        await session.on_item_delete(ItemDelete(item_id=f"item{n}"))
    await session.on_response_create(ResponseCreate())
    await settle(session)
    assert len(templated) == 1 and ws.events[-1]["response"]["status"] == "completed"


@pytest.mark.parametrize("model", ["tiny", "default"])
@pytest.mark.parametrize("counted_by", ["floor", "tokenizer"])
def test_counted_items_are_a_lower_bound_of_the_templated_prompt(model, counted_by, tiny_llama):
    """The refusal above may only refuse what templating would: item counts less EDGE_TOKENS
    never exceed the templated length, whatever the text's edges hold."""
    path = tiny_llama if model == "tiny" else cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (path / "tokenizer.json").exists():
        pytest.skip("the default model is not unpacked here")
    tokenizer = load_tokenizer(path)
    floor = TokenFloor.of(tokenizer) if counted_by == "floor" else None
    if counted_by == "floor" and floor is None:
        pytest.skip("this tokenizer has no floor")
    generation = SimpleNamespace(tokenizer=tokenizer, floor=floor)
    texts = ["Hello there.", "  leading spaces", "trailing spaces   ", "\n\nnew lines\n\n", "a" * 300,
             "<|im_end|>", "x\n", " ", "ünïcödé ✓", "1234567890" * 20, "\t tabs \t"]
    items = [{"id": f"i{n}", "type": "message", "role": ("user", "assistant")[n % 2],
              "content": [{"type": "input_text", "text": text}]} for n, text in enumerate(texts)]
    counts = least_tokens(generation, [item_text(item) for item in items])
    templated = tokenizer.apply_chat_template(conversation_messages(items, item_text), add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    assert sum(max(0, n - EDGE_TOKENS) for n in counts) <= len(templated)
    # And item by item: what each adds to the templated conversation before it.
    lengths = [len(tokenizer.apply_chat_template(conversation_messages(items[:n], item_text), tokenize=True,
                                                 return_dict=False)) if n else 0 for n in range(len(items) + 1)]
    for n, count in enumerate(counts):
        assert count - EDGE_TOKENS <= lengths[n + 1] - lengths[n], (texts[n], count, lengths[n + 1] - lengths[n])


async def test_a_response_echoes_its_metadata_and_one_started_by_the_server_has_none():
    session, ws, _ = scripted_session()
    await session.on_item_create(user_item("hi"))
    await session.on_response_create(ResponseCreate(response=ResponseOptions(metadata={"turn": "7"})))
    await settle(session)
    created = next(e for e in ws.events if e["type"] == "response.created")
    assert created["response"]["metadata"] == {"turn": "7"}
    assert ws.events[-1]["response"]["metadata"] == {"turn": "7"}
    await session.on_response_create(ResponseCreate())
    await settle(session)
    assert ws.events[-1]["response"]["metadata"] is None

