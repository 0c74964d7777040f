"""The conversation a Realtime session keeps: its items in order, and what they cost.

One `Conversation` owns the items by id and every number kept about them: the bytes of their
text (the session's instructions included), at least how many tokens each takes, how much
audio each user item was and the clauses of each spoken answer. For a model that hears audio
itself (an omni model) it also holds each user item's clips, within their own budget (seconds
and clips; keeping more evicts the oldest user items with audio). Items join, leave, are
truncated and evicted through its methods, so those numbers follow the items; the session
adds the instructions' bytes and a response records its spoken clauses and announced ids
directly.
The session decides when (events, turns, answers); this module decides whether an item fits
and what it costs. The functions below read items as plain dicts in the Realtime shape.
"""

from __future__ import annotations

import uuid

import anyio
import numpy as np

from engine.audio_windows import RECOGNIZER_RATE

from frontend.edge_decoding import InvalidInput
from frontend.realtime_events import MessageItem

# Tokens by which an item's text counted alone may exceed its share of the templated prompt:
# where the text meets the template's own text one token may cover bytes of both, at each end.
# With it, the conversation's count is a lower bound, and a response.create refused on it
# would have been refused after templating too.
EDGE_TOKENS = 2


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class Conversation:
    def __init__(self, max_items: int, max_bytes: int, max_audio_seconds: float = 120.0, max_clips: int = 8) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.max_audio_seconds = max_audio_seconds
        self.max_clips = max_clips
        # The conversation, in order, by item id, and the bytes of its text and instructions.
        self.items: dict[str, dict] = {}
        self.bytes = 0
        # At least how many tokens each item's text takes, and the instructions' (text, count):
        # a conversation past the prompt limit is refused without templating it again.
        self.item_tokens: dict[str, int] = {}
        self.instruction_tokens: tuple[str, int] = ("", 0)
        # Ids the server announced for items not in the conversation yet (an answer's, its
        # calls'): a client item may not take them.
        self.announced_ids: set[str] = set()
        # For each spoken answer the clauses heard, with their audio length in ms (for
        # item.truncate); how much audio each user item was, in ms (usage counts it).
        self.spoken: dict[str, list[tuple[str, float]]] = {}
        self.heard_ms: dict[str, float] = {}
        # For a model that hears audio: each user item's clips (float32 at RECOGNIZER_RATE, as
        # heard: the same samples an HTTP request would give), in the order of its input_audio
        # parts, oldest item first; the model hears them, not their transcripts.
        self.clips: dict[str, list[np.ndarray]] = {}

    def holds(self, item: dict) -> bool:
        """Whether `item` itself is still in the conversation (not deleted or evicted)."""
        return self.items.get(item["id"]) is item

    def taken(self, item_id: str) -> bool:
        return item_id in self.items or item_id in self.announced_ids

    def get(self, item_id: str) -> dict:
        item = self.items.get(item_id)
        if item is None:
            raise InvalidInput(f"no item with id {item_id!r}", "item_not_found", "item_id")
        return item

    def refuse_when_full(self, param: str | None) -> None:
        if len(self.items) >= self.max_items:
            raise InvalidInput(f"the conversation holds its limit of {self.max_items} items; "
                               "delete some with conversation.item.delete", "conversation_full", param)

    def instructions_growth(self, old: str, new: str) -> int:
        """How many bytes new instructions add; refused when the conversation has no room for
        them (instructions are templated into every response, like the items)."""
        grown = text_bytes(new) - text_bytes(old)
        if self.bytes + grown > self.max_bytes:
            raise InvalidInput(f"the instructions and the conversation would hold more than "
                               f"{self.max_bytes} bytes of text; shorten them or delete "
                               "items with conversation.item.delete", "conversation_full", "session.instructions")
        return grown

    def check_new_item(self, item: dict, previous: str | None) -> None:
        """A client item may join the conversation after `previous` ("root": first; None: last)."""
        self.refuse_when_full("item")
        item_id = item["id"]
        if item_id == "root":
            # previous_item_id "root" means the start of the conversation: an item so named
            # could not be inserted after.
            raise InvalidInput("'root' names the start of the conversation (previous_item_id); it is not an "
                               "item id", "invalid_value", "item.id")
        if self.taken(item_id):
            raise InvalidInput(f"an item with id {item_id!r} already exists", "duplicate_item_id", "item.id")
        if previous is not None and previous != "root" and previous not in self.items:
            raise InvalidInput(f"no item with id {previous!r}", "item_not_found", "previous_item_id")
        ordered = list(self.items.values())
        earlier = (ordered if previous is None else [] if previous == "root"
                   else ordered[:list(self.items).index(previous) + 1])
        check_call_id(item, earlier, ordered)

    def insert(self, item: dict, previous: str | None, heard_ms: float, clips: list[np.ndarray] = ()) -> str | None:
        """A client item (checked by check_new_item) joins after `previous`, if its text fits
        (its clips, for a hearing model, after make_room_for_clips); the id of the item now
        before it."""
        size = self.check_text_fits(item)
        self.items = insert_after(self.items, item, previous)
        if heard_ms:
            self.heard_ms[item["id"]] = heard_ms
        if clips:
            self.clips[item["id"]] = list(clips)
        self.bytes += size
        return previous_id(self.items, item["id"])

    def check_text_fits(self, item: dict) -> int:
        """The item's text bytes, if they fit the conversation's budget."""
        size = item_bytes(item)
        if self.bytes + size > self.max_bytes:
            raise InvalidInput(f"the conversation would hold more than {self.max_bytes} bytes "
                               "of text (instructions included); delete some items with conversation.item.delete",
                               "conversation_full", "item")
        return size

    def make_room_for_clips(self, clips: list[np.ndarray], param: str | None, keep: str | None = None) -> list[str]:
        """Evicts the oldest user items with audio (never `keep`: the item a new one goes
        after) until `clips` (float32 at RECOGNIZER_RATE) fit the conversation's audio budget;
        the evicted ids. Refuses clips that alone do not fit."""
        seconds = sum(len(clip) for clip in clips) / RECOGNIZER_RATE
        if seconds > self.max_audio_seconds:
            raise InvalidInput(f"{seconds:.1f} s of audio is more than a conversation keeps "
                               f"({self.max_audio_seconds:g} s)", "audio_too_long", param)
        if len(clips) > self.max_clips:
            raise InvalidInput(f"{len(clips)} audio clips are more than a conversation keeps ({self.max_clips})",
                               "too_many_audio_clips", param)
        evicted = []
        candidates = [item_id for item_id in self.clips if item_id != keep]
        while candidates and (self.audio_seconds() + seconds > self.max_audio_seconds
                              or sum(map(len, self.clips.values())) + len(clips) > self.max_clips):
            oldest = candidates.pop(0)
            self.forget(oldest)
            evicted.append(oldest)
        return evicted

    def audio_seconds(self) -> float:
        return sum(len(clip) for clips in self.clips.values() for clip in clips) / RECOGNIZER_RATE

    def append_turn(self, item: dict) -> str | None:
        """A committed turn joins last, before it is heard (its transcript counts once it is);
        the id of the item before it."""
        previous = next(reversed(self.items), None)
        self.items[item["id"]] = item
        return previous

    def transcribed(self, item: dict, text: str, heard_ms: float) -> None:
        """A turn's transcript is its text; it counts if the turn is still in the conversation."""
        item["content"][0]["transcript"] = text
        if self.holds(item):
            self.bytes += text_bytes(text)
            self.heard_ms[item["id"]] = heard_ms
            self.item_tokens.pop(item["id"], None)

    def heard(self, item: dict, clip: np.ndarray) -> None:
        """A turn's audio (after make_room_for_clips), kept for a model that hears it, if the
        turn is still in the conversation."""
        if self.holds(item):
            self.clips[item["id"]] = [clip]
            self.heard_ms[item["id"]] = 1000 * len(clip) / RECOGNIZER_RATE

    def forget(self, item_id: str) -> dict:
        """Takes an item out of the conversation, with what the session knows of it."""
        item = self.items.pop(item_id)
        self.bytes -= item_bytes(item)
        self.clips.pop(item_id, None)
        self.spoken.pop(item_id, None)
        self.heard_ms.pop(item_id, None)
        self.item_tokens.pop(item_id, None)
        return item

    def delete(self, item_id: str) -> None:
        if item_id not in self.items:
            raise InvalidInput(f"no item with id {item_id!r}", "item_not_found", "item_id")
        self.forget(item_id)

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        """Cuts a spoken answer's audio, and its transcript, at what the user heard."""
        item = self.get(item_id)
        clauses = self.spoken.get(item_id)
        # Truncation cuts an assistant item's audio at what the user heard; text items
        # have no audio to cut.
        if clauses is None or content_index != 0:
            raise InvalidInput("only audio content can be truncated, and this item has none there",
                               "invalid_value", "content_index")
        total_ms = sum(ms for _, ms in clauses)
        if audio_end_ms > total_ms:
            raise InvalidInput(f"audio_end_ms {audio_end_ms} is past the item's audio ({total_ms:.0f} ms)",
                               "invalid_value", "audio_end_ms")
        heard = heard_transcript(clauses, audio_end_ms)
        part = item["content"][0]
        self.bytes += text_bytes(heard) - text_bytes(part["transcript"])
        part["transcript"] = heard
        self.item_tokens.pop(item_id, None)
        self.spoken[item_id] = [(heard, float(audio_end_ms))]

    def item_content(self, item: dict) -> str | list[dict]:
        """Text for the chat template, or the parts when the item holds images or heard clips.
        Audio is its clip where the model hears it, else its transcript (the language model
        hears what the recognizer heard)."""
        # Only the conversation's own item: an out-of-band item may reuse its id.
        clips = iter(self.clips.get(item["id"], ()) if self.holds(item) else ())
        parts = []
        for part in item["content"]:
            clip = next(clips, None) if part["type"] == "input_audio" else None
            if clip is not None:
                parts.append({"type": "audio", "audio": (clip, RECOGNIZER_RATE)})
            elif part["type"] == "input_image":
                parts.append(part)
            else:
                parts.append({"type": "input_text", "text": part_text(part)})
        if any(part["type"] != "input_text" for part in parts):
            return parts
        return "".join(part["text"] for part in parts)

    def add_answer(self, item: dict) -> list[str]:
        """Append an answer to the conversation; the ids of the oldest items evicted to make room.

        The client already holds the answer's id (from response.output_item.done), so the
        answer is never the one dropped. One answer alone may exceed the byte budget.
        """
        size = item_bytes(item)
        evicted = []
        while self.items and (len(self.items) >= self.max_items or self.bytes + size > self.max_bytes):
            oldest = next(iter(self.items))
            self.forget(oldest)
            evicted.append(oldest)
        self.items[item["id"]] = item
        self.bytes += size
        return evicted

    async def refuse_past_prompt_limit(self, items: list[dict], instructions: str, generation) -> None:
        """Refuses the conversation when its text alone is past the prompt limit. Each item is
        counted once (off the loop) and remembered, so that asking again and again for a
        response to a conversation too long costs nothing but the sum."""
        uncounted = [item for item in items if item["id"] not in self.item_tokens]
        texts = [item_text(item) for item in uncounted]
        new_instructions = instructions != self.instruction_tokens[0]
        if new_instructions:
            texts.append(instructions)
        if texts:
            counts = await anyio.to_thread.run_sync(least_tokens, generation, texts)
            for item, count in zip(uncounted, counts):
                if self.holds(item):  # not deleted or evicted meanwhile
                    self.item_tokens[item["id"]] = count
            if new_instructions:
                self.instruction_tokens = (instructions, counts[-1])
        least = sum(max(0, self.item_tokens.get(item["id"], 0) - EDGE_TOKENS) for item in items)
        least += max(0, self.instruction_tokens[1] - EDGE_TOKENS) if instructions else 0
        if least > generation.max_prompt_tokens:
            raise InvalidInput(f"the conversation is at least {least} tokens; a prompt may have "
                               f"{generation.max_prompt_tokens}: delete items with conversation.item.delete",
                               "prompt_too_long")


def message_item(item: MessageItem, takes_images: bool) -> dict:
    if item.type != "message":
        return {"id": item.id or new_id("item"), "object": "realtime.item", "type": item.type, "status": "completed",
                **item.function_fields()}
    parts = item.parts()  # refuses parts of other types
    if not takes_images and any(part["type"] == "input_image" for part in parts):
        raise InvalidInput("this model takes no images", "unsupported_content_type", "item.content")
    return {"id": item.id or new_id("item"), "object": "realtime.item", "type": "message",
            "role": item.role, "status": "completed", "content": parts}


def insert_after(items: dict[str, dict], item: dict, previous_id: str | None) -> dict[str, dict]:
    """Items in order with `item` after `previous_id` ("root": first; None: last)."""
    if previous_id is None:
        items[item["id"]] = item
        return items
    ordered = list(items.items())
    at = 0 if previous_id == "root" else next(i for i, (key, _) in enumerate(ordered) if key == previous_id) + 1
    ordered.insert(at, (item["id"], item))
    return dict(ordered)


def previous_id(items: dict[str, dict], item_id: str) -> str | None:
    previous = None
    for key in items:
        if key == item_id:
            return previous
        previous = key
    return None


def item_text(item: dict) -> str:
    """What of an item becomes prompt text (an image's tokens are known only once it is read)."""
    if item["type"] == "message":
        return "".join(part_text(part) for part in item["content"] if part["type"] != "input_image")
    return "".join(item.get(name) or "" for name in ("name", "arguments", "output"))


def least_tokens(generation, texts: list[str]) -> list[int]:
    """At least how many tokens each text takes: the floor found from its bytes where the
    tokenizer has one (engine/token_floor.py: no tokenizing), else its tokens counted."""
    if generation.floor is not None:
        return [generation.floor.tokens(text) for text in texts]
    return [len(ids) for ids in generation.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def check_call_id(item: dict, earlier: list[dict], items: list[dict], param: str = "item") -> None:
    """A function_call_output answers one function_call before it, and only once; a
    function_call's call_id is its own. `earlier`: the items before `item`; `items`: all."""
    if item["type"] == "message":
        return
    call_id = item["call_id"]
    if item["type"] == "function_call":
        if any(i["type"] == "function_call" and i["call_id"] == call_id for i in items if i is not item):
            raise InvalidInput(f"a function_call with call_id {call_id!r} already exists", "invalid_call_id",
                               f"{param}.call_id")
        return
    if not any(i["type"] == "function_call" and i["call_id"] == call_id for i in earlier):
        raise InvalidInput(f"no function_call item before this one has call_id {call_id!r}", "invalid_call_id",
                           f"{param}.call_id")
    if any(i["type"] == "function_call_output" and i["call_id"] == call_id for i in items if i is not item):
        raise InvalidInput(f"the function_call {call_id!r} already has an output", "invalid_call_id",
                           f"{param}.call_id")


def heard_transcript(clauses: list[tuple[str, float]], end_ms: float) -> str:
    """The words of a spoken answer heard before `end_ms`: whole clauses, then the share of
    the interrupted clause's words that its audio had reached."""
    words, elapsed = [], 0.0
    for text, ms in clauses:
        if elapsed + ms <= end_ms:
            words.append(text)
        else:
            clause_words = text.split()
            share = max(0.0, end_ms - elapsed) / ms if ms else 0.0
            words.append(" ".join(clause_words[:int(len(clause_words) * share)]))
            break
        elapsed += ms
    return " ".join(w for w in words if w)


def part_text(part: dict) -> str:
    return part.get("text") or part.get("transcript") or ""


def text_bytes(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def item_bytes(item: dict) -> int:
    if item["type"] != "message":
        return sum(text_bytes(item.get(name) or "") for name in ("name", "arguments", "output"))
    return sum(len(part["image_url"]) if part["type"] == "input_image" else text_bytes(part_text(part))
               for part in item["content"])
