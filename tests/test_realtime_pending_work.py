"""A Realtime session never stops reading its socket while work for it runs.

A transcription that waits on a busy encoder used to be awaited inside the receive loop: no
event was read meanwhile, and neither was the client's pong, so the server closed the socket
(1011, keepalive ping timeout). Here the session runs its real receive loop on a socket fake,
against an encoder whose transcriptions wait until the test lets them go.
"""

import asyncio
import base64
import json
from types import SimpleNamespace

import numpy as np
from starlette.websockets import WebSocketState

from engine import protocol
from frontend.generation import TextChunk
from frontend.realtime import RealtimeSession
from frontend.server_config import ServerConfig
from frontend.tenancy import ANONYMOUS, Requester
from tests.test_realtime_closing import ScriptedGeneration

WAIT_S = 5.0
MANUAL_TURNS = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}


class SocketFake:
    """The client's side of the socket: events go in as messages; what the session sends is
    kept, in order."""

    application_state = WebSocketState.CONNECTED

    def __init__(self) -> None:
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.events: list[dict] = []
        self.sent = asyncio.Event()
        self.read = 0  # events already returned by next_event

    def send_event(self, event: dict) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(event)})

    def disconnect(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})

    async def receive(self) -> dict:
        return await self.incoming.get()

    async def send_text(self, text: str) -> None:
        self.events.append(json.loads(text))
        self.sent.set()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.disconnect()

    async def next_event(self, event_type: str, timeout: float = WAIT_S) -> dict:
        """The next event of this type after those already returned."""
        async with asyncio.timeout(timeout):
            while True:
                for at in range(self.read, len(self.events)):
                    if self.events[at]["type"] == event_type:
                        self.read = at + 1
                        return self.events[at]
                self.sent.clear()
                await self.sent.wait()

    def types(self) -> list[str]:
        return [event["type"] for event in self.events]


class HeldEncoder:
    """An engine client whose transcriptions wait until `release` is set."""

    voice_ready = True
    # The cascade speaks: the model does not speak for itself.
    speaks_itself = False
    voices: list[str] = []

    def __init__(self, text: str = "what is the capital of france") -> None:
        self.text = text
        self.release = asyncio.Event()
        self.pending = 0
        self.cancelled = 0
        self.requesters: list[Requester] = []

    async def transcribe(self, samples, requester: Requester = ANONYMOUS) -> protocol.AudioTranscript:
        self.pending += 1
        self.requesters.append(requester)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.pending -= 1
        return protocol.AudioTranscript(request_id="clip", text=self.text, no_speech_probability=0.0)


class RecordingGeneration(ScriptedGeneration):
    """Keeps the messages of every prompt it templates; `hold` keeps a stream from ending."""

    def __init__(self, chunks) -> None:
        super().__init__(chunks)
        self.prompts: list[list[dict]] = []
        self.hold: asyncio.Event | None = None

    async def chat_prompt(self, messages, tools=None):
        self.prompts.append(messages)
        return [1, 2, 3]

    async def stream(self, lease, prompt, params, cache_salt=None, speech=None, conversation=None):
        try:
            for chunk in self.chunks:
                if self.hold is not None:
                    await self.hold.wait()
                await asyncio.sleep(0)
                yield chunk
        finally:
            lease.release()


ANSWER = [TextChunk("Paris", [5], finish_reason="stop", num_prompt_tokens=3, num_output_tokens=1)]


def voice_session(**limits):
    socket, encoder, generation = SocketFake(), HeldEncoder(), RecordingGeneration(ANSWER)
    state = SimpleNamespace(config=ServerConfig(**limits), model_name="tiny", generation=generation, client=encoder,
                            engine_config=SimpleNamespace(voice=True), grammar_checker=None)
    requester = Requester(tenant="tenant-a", client="10.0.0.7")
    session = RealtimeSession(socket, state, requester=requester)
    return session, socket, encoder, generation


def one_second_of_audio() -> dict:
    pcm = (np.sin(np.arange(24000) / 10) * 8000).astype("<i2").tobytes()
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}


async def committed_turn(socket: SocketFake, encoder: HeldEncoder) -> None:
    """A manual turn committed, its transcription pending."""
    socket.send_event(MANUAL_TURNS)
    await socket.next_event("session.updated")
    socket.send_event(one_second_of_audio())
    socket.send_event({"type": "input_audio_buffer.commit", "event_id": "commit_1"})
    await socket.next_event("conversation.item.added")
    async with asyncio.timeout(WAIT_S):
        while encoder.pending == 0:
            await asyncio.sleep(0.01)


async def test_a_session_goes_on_reading_and_answering_while_its_transcript_is_pending():
    session, socket, encoder, generation = voice_session()
    run = asyncio.create_task(session.run())
    await committed_turn(socket, encoder)

    # Events sent while the turn is heard are read and answered.
    socket.send_event({"type": "session.update", "session": {"temperature": 0.3}})
    assert (await socket.next_event("session.updated"))["session"]["temperature"] == 0.3
    socket.send_event({"type": "response.create", "event_id": "create_1"})
    socket.send_event(one_second_of_audio())
    socket.send_event({"type": "input_audio_buffer.clear"})
    await socket.next_event("input_audio_buffer.cleared")
    # The response waits for the transcript it answers.
    assert encoder.pending == 1
    assert "response.created" not in socket.types()
    assert "conversation.item.input_audio_transcription.completed" not in socket.types()

    encoder.release.set()
    await socket.next_event("response.done")
    types = socket.types()
    assert types.index("conversation.item.input_audio_transcription.completed") < types.index("response.created")
    (messages,) = generation.prompts
    assert messages[-1] == {"role": "user", "content": encoder.text}
    # The transcription counted against this session's requester's share.
    assert encoder.requesters == [session.requester]
    socket.disconnect()
    await asyncio.wait_for(run, WAIT_S)


async def test_a_response_cancel_stops_the_playing_answer_while_a_transcript_is_pending():
    session, socket, encoder, generation = voice_session()
    run = asyncio.create_task(session.run())
    generation.hold = asyncio.Event()  # the answer streams until let go: it is playing
    socket.send_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}})
    socket.send_event({"type": "response.create"})
    playing = (await socket.next_event("response.created"))["response"]["id"]
    await committed_turn(socket, encoder)

    socket.send_event({"type": "response.cancel"})
    done = await socket.next_event("response.done")
    assert done["response"]["id"] == playing and done["response"]["status"] == "cancelled"
    assert encoder.pending == 1  # the turn is still being heard
    encoder.release.set()
    await socket.next_event("conversation.item.input_audio_transcription.completed")
    socket.disconnect()
    await asyncio.wait_for(run, WAIT_S)


async def test_a_closing_session_cancels_and_awaits_its_pending_work():
    session, socket, encoder, generation = voice_session()
    before = asyncio.all_tasks()
    run = asyncio.create_task(session.run())
    await committed_turn(socket, encoder)
    socket.send_event({"type": "response.create"})  # waits behind the transcript
    socket.send_event({"type": "session.update", "session": {"temperature": 0.1}})
    await socket.next_event("session.updated")

    socket.disconnect()
    await asyncio.wait_for(run, WAIT_S)
    assert encoder.pending == 0 and encoder.cancelled == 1
    assert not session.inbox.busy and not session.conversation.busy and not session.tasks
    left = [task for task in asyncio.all_tasks() - before if task is not asyncio.current_task()]
    assert left == [], left
    assert generation.admission.held == 0 and generation.prompts == []


async def test_events_past_the_queue_bound_are_refused_and_the_rest_are_handled_in_order():
    session, socket, encoder, generation = voice_session(max_queued_events=2)
    run = asyncio.create_task(session.run())
    await committed_turn(socket, encoder)
    for n in range(3):
        socket.send_event({"type": "conversation.item.retrieve", "item_id": f"none_{n}", "event_id": f"get_{n}"})
    error = (await socket.next_event("error"))["error"]
    assert (error["code"], error["event_id"]) == ("too_many_queued_events", "get_2")

    encoder.release.set()
    answered = [(await socket.next_event("error"))["error"]["event_id"] for _ in range(2)]
    assert answered == ["get_0", "get_1"]
    socket.disconnect()
    await asyncio.wait_for(run, WAIT_S)
