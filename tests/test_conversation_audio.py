"""A Realtime conversation's audio for a model that hears it (frontend/realtime_conversation.py):
its own budget of seconds and clips, the oldest user items with audio evicted to keep a new
one, and a clip never lent to an out-of-band item that reuses its id."""

import numpy as np
import pytest

from frontend.edge_decoding import InvalidInput
from frontend.realtime_conversation import Conversation

RATE = 16000


def user_item(item_id: str) -> dict:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_audio", "transcript": None}]}


def keep(conversation: Conversation, item_id: str, seconds: float) -> list[str]:
    clip = np.zeros(int(seconds * RATE), np.float32)
    evicted = conversation.make_room_for_clips([clip], "item")
    conversation.insert(user_item(item_id), None, 1000 * seconds, [clip])
    return evicted


def test_keeping_more_audio_evicts_the_oldest_items_with_audio():
    conversation = Conversation(max_items=50, max_bytes=1 << 20, max_audio_seconds=10.0, max_clips=3)
    assert keep(conversation, "a", 4.0) == [] and keep(conversation, "b", 4.0) == []
    assert keep(conversation, "c", 4.0) == ["a"]  # 12 s > 10 s
    assert keep(conversation, "d", 1.0) == []
    assert keep(conversation, "e", 1.0) == ["b"]  # a fourth clip
    assert list(conversation.items) == ["c", "d", "e"] and conversation.audio_seconds() == 6.0
    conversation.delete("c")
    assert conversation.audio_seconds() == 2.0 and "c" not in conversation.clips


def test_a_clip_larger_than_the_whole_budget_is_refused_and_evicts_nothing():
    conversation = Conversation(max_items=50, max_bytes=1 << 20, max_audio_seconds=10.0, max_clips=3)
    keep(conversation, "a", 4.0)
    with pytest.raises(InvalidInput) as error:
        keep(conversation, "big", 11.0)
    assert error.value.code == "audio_too_long"
    assert list(conversation.items) == ["a"]


def test_the_model_hears_a_clip_only_through_its_own_item():
    conversation = Conversation(max_items=50, max_bytes=1 << 20)
    keep(conversation, "a", 1.0)
    content = conversation.item_content(conversation.items["a"])
    assert content[0]["type"] == "audio" and content[0]["audio"][1] == RATE
    # An out-of-band item (response.input) that reuses the id gets its transcript, not the clip.
    assert conversation.item_content(user_item("a")) == ""
