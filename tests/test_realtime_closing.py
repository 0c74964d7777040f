"""A Realtime response always closes: a response.cancel that lands while it finishes, or between
its opening events, cannot cut or repeat its events, lose its response.done or its answer.

The session runs against a fake WebSocket whose sends can be held at a chosen event, and a
scripted generation service, so each race is forced rather than hoped for.
"""

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.websockets import WebSocketState

from frontend.admission import Admission
from frontend.edge_decoding import ContentPart, InvalidInput
from frontend.generation import TextChunk
from frontend.realtime import RealtimeSession
from frontend.realtime_events import ItemCreate, MessageItem, ResponseCancel, ResponseCreate
from frontend.server_config import ServerConfig
from frontend.tool_parsers import parser_for

ANSWER = [TextChunk("Hello", [5]), TextChunk(" there", [6], finish_reason="stop", num_prompt_tokens=3,
                                             num_output_tokens=2)]


class FakeWebSocket:
    """Collects the events sent; a send of an event type in `held` waits until it is let go."""

    application_state = WebSocketState.CONNECTED

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.held: dict[str, asyncio.Event] = {}
        self.reached: dict[str, asyncio.Event] = {}

    def hold(self, event_type: str) -> tuple[asyncio.Event, asyncio.Event]:
        """(reached, release): set when a send of this type starts; set it to let the send go."""
        self.reached[event_type], self.held[event_type] = asyncio.Event(), asyncio.Event()
        return self.reached[event_type], self.held[event_type]

    async def send_text(self, text: str) -> None:
        event = json.loads(text)
        if event["type"] in self.held:
            self.reached[event["type"]].set()
            await self.held[event["type"]].wait()  # a cancel here means it was never written
        self.events.append(event)

    def types(self) -> list[str]:
        return [event["type"] for event in self.events]


class NoEngine:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class WordTokenizer:
    """One token per word, in a Hugging Face tokenizer's calling shape."""

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict:
        return {"input_ids": [list(range(len(text.split()))) for text in texts]}


class ScriptedGeneration:
    """Admits into a real Admission and streams the same chunks for every request."""

    tokenizer = WordTokenizer()
    floor = None  # counted by the tokenizer
    max_prompt_tokens = 8192
    tool_parser = parser_for()
    hears_audio = False  # a text model: turns are transcribed

    def __init__(self, chunks: list[TextChunk]) -> None:
        self.admission = Admission(8)
        self.engine = NoEngine()
        self.chunks = chunks

    def admit(self, request_id: str):
        return self.admission.admit(self.engine, request_id)

    async def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return [1, 2, 3]

    async def stream(self, lease, prompt, params, cache_salt=None, speech=None, conversation=None):
        try:
            for chunk in self.chunks:
                await asyncio.sleep(0)
                yield chunk
        finally:
            lease.release()


def scripted_session(chunks=ANSWER, **limits) -> tuple[RealtimeSession, FakeWebSocket, ScriptedGeneration]:
    ws, generation = FakeWebSocket(), ScriptedGeneration(chunks)
    # A text model's engine client: the model does not speak for itself.
    client = SimpleNamespace(speaks_itself=False, voices=[])
    state = SimpleNamespace(config=ServerConfig(**limits), model_name="tiny", generation=generation, client=client)
    return RealtimeSession(ws, state), ws, generation


def user_item(text: str, item_id: str | None = None) -> ItemCreate:
    return ItemCreate(item=MessageItem(role="user", content=[ContentPart("input_text", text)], id=item_id))


async def settle(session: RealtimeSession) -> None:
    """Wait for every response of the session to end."""
    if session.responses:
        await asyncio.wait_for(asyncio.gather(*session.responses.values(), return_exceptions=True), 5)


async def test_a_cancel_while_the_response_finishes_keeps_its_closing_events_and_answer():
    session, ws, generation = scripted_session()
    await session.on_item_create(user_item("hi"))
    reached, release = ws.hold("response.output_text.done")
    await session.on_response_create(ResponseCreate())
    await asyncio.wait_for(reached.wait(), 5)  # the stream ended; the response is closing
    cancel = asyncio.create_task(session.on_response_cancel(ResponseCancel()))
    for _ in range(5):
        await asyncio.sleep(0)
    release.set()
    await asyncio.wait_for(cancel, 5)

    types = ws.types()
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.done"], types
    assert types.count("response.done") == 1
    done = ws.events[-1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello there"
    answer_id = ws.events[-2]["item"]["id"]
    assert session.items[answer_id]["content"][0]["text"] == "Hello there"
    assert session.responses == {} and session.finishing == set() and session.conversation_response is None
    assert generation.admission.held == 0


async def test_a_cancel_between_opening_events_sends_each_event_once():
    session, ws, generation = scripted_session()
    await session.on_item_create(user_item("hi"))
    reached, release = ws.hold("response.output_item.added")
    await session.on_response_create(ResponseCreate())
    await asyncio.wait_for(reached.wait(), 5)
    await asyncio.wait_for(session.on_response_cancel(ResponseCancel()), 5)

    # response.created went out, output_item.added never did: no repeat, no item to close.
    assert ws.types() == ["conversation.item.added", "response.created", "response.done"]
    done = ws.events[-1]["response"]
    assert done["status"] == "cancelled" and done["output"] == []
    assert generation.admission.held == 0


async def test_a_cancel_right_behind_the_create_still_announces_then_ends_the_response():
    session, ws, generation = scripted_session()
    await session.on_item_create(user_item("hi"))
    await session.on_response_create(ResponseCreate())
    # As the receive loop does with a message already queued: no yield in between.
    await session.on_response_cancel(ResponseCancel())

    assert ws.types() == ["conversation.item.added", "response.created", "response.done"]
    assert ws.events[1]["response"]["id"] == ws.events[2]["response"]["id"]
    assert ws.events[2]["response"]["status"] == "cancelled"
    assert generation.admission.held == 0 and generation.engine.released == [ws.events[2]["response"]["id"]]


async def test_a_cancel_after_the_response_done_is_refused_and_sends_nothing_else():
    session, ws, _ = scripted_session()
    await session.on_item_create(user_item("hi"))
    await session.on_response_create(ResponseCreate())
    await settle(session)
    sent = len(ws.events)
    with pytest.raises(InvalidInput) as refused:
        await session.on_response_cancel(ResponseCancel())
    assert refused.value.code == "response_cancel_not_active"
    assert len(ws.events) == sent and ws.types().count("response.done") == 1
