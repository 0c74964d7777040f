"""The Realtime SDK (frontend/client.py) tells its own responses from those server VAD starts.

When a turn's end starts a response while the client's own response.create is on its way,
the server announces both; the SDK used to hand the first response.created to the caller of
create_response, whichever it was. A scripted server here announces the VAD one first.
"""

import asyncio
import json

import websockets

from frontend.client import RealtimeClient


def response_events(response_id: str, metadata, text: str) -> list[dict]:
    response = {"id": response_id, "object": "realtime.response", "status": "in_progress", "output": [],
                "metadata": metadata}
    return [{"type": "response.created", "response": response},
            {"type": "response.output_text.delta", "response_id": response_id, "delta": text},
            {"type": "response.done", "response": {**response, "status": "completed"}}]


async def vad_races_every_create(ws) -> None:
    """A server that, on each response.create, first starts a response of its own (as server
    VAD does when a turn ends) and only then the one asked for."""
    await ws.send(json.dumps({"type": "session.created", "session": {"id": "sess_1"}}))
    async for data in ws:
        event = json.loads(data)
        if event["type"] != "response.create":
            continue
        vad = response_events("resp_vad", None, "answer to the spoken turn")
        asked = response_events("resp_asked", event["response"].get("metadata"), "answer to the text")
        for message in vad[:1] + asked[:1] + vad[1:] + asked[1:]:
            await ws.send(json.dumps(message))


async def test_a_response_started_by_server_vad_is_never_handed_to_create_response():
    async with websockets.serve(vad_races_every_create, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with RealtimeClient(f"ws://127.0.0.1:{port}") as client:
            mine = await asyncio.wait_for(client.create_response(metadata={"topic": "weather"}), 5)
            await asyncio.wait_for(mine.wait(), 5)
            theirs = await asyncio.wait_for(client.next_response(), 5)
            await asyncio.wait_for(theirs.wait(), 5)
    assert (mine.id, mine.text) == ("resp_asked", "answer to the text")
    assert (theirs.id, theirs.text) == ("resp_vad", "answer to the spoken turn")
    # The caller's own metadata went out with the SDK's tag beside it.
    assert mine.raw["metadata"]["topic"] == "weather"


async def test_create_response_refuses_metadata_with_no_room_for_its_own_key():
    async with websockets.serve(vad_races_every_create, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with RealtimeClient(f"ws://127.0.0.1:{port}") as client:
            full = {f"key{index}": "value" for index in range(16)}
            try:
                await client.create_response(metadata=full)
            except ValueError as exc:
                assert "at most 15 keys" in str(exc)
            else:
                raise AssertionError("16 keys of the caller's were sent on, and the server refuses 17")
            # 15 keys and the SDK's fit the server's bound.
            mine = await asyncio.wait_for(client.create_response(metadata=dict(list(full.items())[:15])), 5)
            await asyncio.wait_for(mine.wait(), 5)
    assert len(mine.raw["metadata"]) == 16
