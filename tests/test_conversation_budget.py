"""A Realtime conversation stays within its item cap and byte budget, instructions included, and
an answer the client was already told about is never dropped: the oldest items make room."""

import pytest

from frontend.edge_decoding import InvalidInput
from frontend.realtime_events import ResponseCreate, SessionSettings, SessionUpdate
from tests.test_realtime_closing import scripted_session, settle, user_item


async def answer(session) -> str:
    """Run one conversation response to its end; the id of its answer item."""
    await session.on_response_create(ResponseCreate())
    await settle(session)
    return session.ws.events[-1]["response"]["output"][0]["id"]


async def test_an_answer_at_the_item_cap_evicts_the_oldest_items_not_the_answer():
    session, ws, _ = scripted_session(max_conversation_items=3)
    for n in range(3):
        await session.on_item_create(user_item(f"m{n}", f"item{n}"))
    answer_id = await answer(session)

    assert list(session.items) == ["item1", "item2", answer_id]
    types = ws.types()
    # The eviction is told after the answer's own events, before its response.done.
    assert types[-3:] == ["response.output_item.done", "conversation.item.deleted", "response.done"], types
    assert ws.events[-2]["item_id"] == "item0"
    second_id = await answer(session)
    assert list(session.items) == ["item2", answer_id, second_id]
    assert (ws.events[-2]["type"], ws.events[-2]["item_id"]) == ("conversation.item.deleted", "item1")


async def test_an_answer_past_the_byte_budget_evicts_the_oldest_items_until_it_fits():
    session, ws, _ = scripted_session(max_conversation_bytes=20)
    await session.on_item_create(user_item("a" * 8, "first"))
    await session.on_item_create(user_item("b" * 8, "second"))
    answer_id = await answer(session)  # "Hello there": 11 bytes; 16 + 11 > 20

    assert list(session.items) == ["second", answer_id]
    assert session.conversation_bytes == 8 + 11
    assert [e["item_id"] for e in ws.events if e["type"] == "conversation.item.deleted"] == ["first"]


async def test_an_answer_alone_over_the_budget_is_kept():
    session, ws, _ = scripted_session(max_conversation_bytes=10)
    await session.on_item_create(user_item("a" * 4, "question"))
    answer_id = await answer(session)

    assert list(session.items) == [answer_id] and session.conversation_bytes == 11


async def test_instructions_count_in_the_conversation_byte_budget():
    session, ws, _ = scripted_session(max_conversation_bytes=16)
    await session.on_session_update(SessionUpdate(session=SessionSettings(instructions="x" * 10)))
    assert session.conversation_bytes == 10
    with pytest.raises(InvalidInput) as full:
        await session.on_item_create(user_item("y" * 7))
    assert full.value.code == "conversation_full"
    await session.on_item_create(user_item("y" * 6, "fits"))
    with pytest.raises(InvalidInput) as too_long:
        await session.on_session_update(SessionUpdate(session=SessionSettings(instructions="x" * 11)))
    assert (too_long.value.code, too_long.value.param) == ("conversation_full", "session.instructions")
    assert session.session["instructions"] == "x" * 10 and session.conversation_bytes == 16
    # Shorter instructions free their bytes for items.
    await session.on_session_update(SessionUpdate(session=SessionSettings(instructions="x")))
    await session.on_item_create(user_item("z" * 9))
    assert session.conversation_bytes == 16


async def test_an_answer_makes_room_past_the_instructions_without_evicting_them():
    session, ws, _ = scripted_session(max_conversation_bytes=20)
    await session.on_session_update(SessionUpdate(session=SessionSettings(instructions="x" * 8)))
    await session.on_item_create(user_item("a" * 4, "question"))
    answer_id = await answer(session)  # 8 + 4 + 11 > 20: the question goes, the instructions stay

    assert list(session.items) == [answer_id]
    assert session.session["instructions"] == "x" * 8 and session.conversation_bytes == 8 + 11
