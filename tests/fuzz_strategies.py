"""Hypothesis strategies for hostile but plausible client input, as the exact bytes a client sends.

Two families: bodies for POST /v1/chat/completions (`http_cases`) and sequences of Realtime
frames over one WebSocket (`realtime_sequences`). Each draws from three layers, so that a
useful share of the input gets past validation into generation, where the leaks live:
valid requests, valid requests with one to three fields made hostile, and outright garbage
(wrong types everywhere, huge integers, NaN literals, deep nesting, invalid UTF-8, non-JSON).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from hypothesis import strategies as st

# Integers that break whatever stores them: int32, float64's exact range, int64, uint64, beyond.
HUGE_INTS = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63) - 1, -(2**70)]
SPECIAL_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0, 1e-300]
LONE_SURROGATE = "\ud800"
ODD_STRINGS = ["", " ", "x", "4", "-1", "1e400", "inf", "NaN", "null", "true", LONE_SURROGATE, "\x00",
               "\u202e", "\U0001F600" * 3, "<|im_end|>", "<|im_start|>assistant\n"]
SHORT_TEXTS = ["hi", "Hello!", "Paris is the capital of", "2+2=", "caf\u00e9 \u65e5\u672c",
               "The quick brown fox", "\U0001F600"]
# Deep enough to overflow any recursive JSON parser (Python's gives up near 1,000).
DEPTH = 10_000
DEEP_ARRAY = "[" * DEPTH + "]" * DEPTH
DEEP_OBJECT = '{"a":' * DEPTH + "1" + "}" * DEPTH

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(HUGE_INTS), st.sampled_from(SPECIAL_FLOATS),
    st.floats(), st.sampled_from(ODD_STRINGS), st.text(max_size=12))

json_values = st.recursive(
    scalars, lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children,
                                                                               max_size=3),
    max_leaves=8)


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, in proportion to its weight (naming one twice in st.one_of does not)."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(pool) - 1).flatmap(lambda i: pool[i])


def hostile(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field's valid values or anything at all."""
    return st.one_of(valid, json_values)


def count(valid: st.SearchStrategy) -> st.SearchStrategy:
    """An integer field (token counts, seeds, indices): valid, huge, negative, fractional, a string."""
    return st.one_of(valid, st.sampled_from(HUGE_INTS), st.integers(-(2**16), 0), st.sampled_from(SPECIAL_FLOATS),
                     st.sampled_from([1.5, "4", "inf", True, [4], {"value": 4}]), json_values)


def number(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A float field (temperature, top_p, penalties)."""
    return st.one_of(valid, st.sampled_from(SPECIAL_FLOATS), st.sampled_from(HUGE_INTS), st.floats(),
                     st.sampled_from(["0.5", True, [0.5]]), json_values)


def long_text(min_repeats: int, max_repeats: int, pieces: tuple[str, ...] = ("a", "\u00e9", " x")) -> st.SearchStrategy:
    """A piece repeated; JSON writes \u00e9 as six bytes, so Realtime frames use ASCII pieces only."""
    return st.builds(lambda n, piece: piece * n, st.integers(min_repeats, max_repeats), st.sampled_from(pieces))


# ---- chat completions ----------------------------------------------------------------------

ROLES = ["user", "system", "assistant", "developer"]
valid_message = st.fixed_dictionaries({"role": st.sampled_from(ROLES),
                                       "content": st.sampled_from(SHORT_TEXTS) | st.text(max_size=24)})
valid_messages = st.builds(lambda history, last: history + [{"role": "user", "content": last}],
                           st.lists(valid_message, max_size=3), st.sampled_from(SHORT_TEXTS))

content_parts = st.fixed_dictionaries(
    {"type": hostile(st.sampled_from(["text", "input_text", "image_url", "input_audio", "file", "video", "weird"]))},
    optional={"text": hostile(st.sampled_from(SHORT_TEXTS)),
              "image_url": hostile(st.just({"url": "data:image/png;base64,iVBORw0KGgo="})),
              "input_audio": hostile(st.just({"data": "AAAA", "format": "wav"}))})

odd_message = st.fixed_dictionaries({}, optional={
    "role": hostile(st.sampled_from(ROLES + ["tool", "function", "USER", "", "model"])),
    "content": st.one_of(st.sampled_from(SHORT_TEXTS + [LONE_SURROGATE, ""]), long_text(200, 2000),
                         st.lists(content_parts | json_values, max_size=3), json_values),
    "name": json_values, "tool_calls": json_values, "tool_call_id": json_values})

hostile_messages = st.one_of(
    st.sampled_from([5, "hi", None, [], {}, [5], [None], [[]], [{"role": "user"}], [{"content": "hi"}]]),
    st.lists(odd_message | valid_message, min_size=1, max_size=4),
    st.lists(valid_message, min_size=40, max_size=200),  # a prompt past the context
    json_values)

stops = st.one_of(st.none(), st.sampled_from(SHORT_TEXTS), st.lists(st.sampled_from(SHORT_TEXTS), max_size=4))
hostile_stops = st.one_of(
    st.sampled_from([[""], "", [5], [["a"]], {"a": 1}, 5, True, [None]]),
    long_text(1000, 60_000),
    st.builds(lambda n: ["ab"] * n, st.integers(9, 10_000)),
    json_values)

# field: (valid values, hostile values)
CHAT_FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "messages": (valid_messages, hostile_messages),
    "model": (st.just("tiny"), json_values),
    "max_tokens": (st.integers(1, 4), count(st.just(10**6))),
    "max_completion_tokens": (st.integers(1, 4) | st.none(), count(st.just(10**6))),
    "temperature": (st.sampled_from([0, 0.0, 0.7, 1, 2.0]), number(st.just(1e9))),
    "top_p": (st.sampled_from([0.1, 0.9, 1]), number(st.just(0.0))),
    "top_k": (st.integers(0, 50), count(st.just(10**9))),
    "min_p": (st.sampled_from([0.0, 0.2, 1.0]), number(st.just(1.5))),
    "seed": (st.integers(-(2**63), 2**63 - 1) | st.none(), count(st.just(0))),
    "stop": (stops, hostile_stops),
    "stream": (st.sampled_from([True, True, False]), hostile(st.sampled_from(["x", "true", 1, 0]))),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | st.none(),
                       st.one_of(st.sampled_from(["x", 5, [], True]),
                                 st.fixed_dictionaries({"include_usage": json_values}), json_values)),
    "n": (st.just(1), count(st.sampled_from([0, 2]))),
    "presence_penalty": (st.sampled_from([0, -2, 2, 0.5]), number(st.just(2.5))),
    "frequency_penalty": (st.sampled_from([0, -2, 2, 0.5]), number(st.just(-3))),
    "repetition_penalty": (st.sampled_from([1, 1.1, 0.5]), number(st.just(0))),
    "ignore_eos": (st.booleans(), json_values),
    "logprobs": (st.booleans(), json_values),
    "top_logprobs": (st.integers(0, 20), count(st.just(21))),
    "return_token_ids": (st.booleans(), json_values),
    "user": (st.text(max_size=8), json_values),
    "tools": (st.just([]), json_values),
    "response_format": (st.just({"type": "text"}), json_values),
    "unknown_field": (json_values, json_values),
}
OPTIONAL_FIELDS = [name for name in CHAT_FIELDS if name != "messages"]


@st.composite
def chat_bodies(draw) -> dict:
    """A valid request, that request with one to three hostile fields, or hostile throughout."""
    layer = draw(st.sampled_from(["valid", "some_bad", "all_bad"]))
    pick = (lambda name: CHAT_FIELDS[name][1]) if layer == "all_bad" else (lambda name: CHAT_FIELDS[name][0])
    body = draw(st.fixed_dictionaries({"messages": pick("messages")},
                                      optional={name: pick(name) for name in OPTIONAL_FIELDS}))
    if layer == "some_bad":
        for name in draw(st.lists(st.sampled_from(list(CHAT_FIELDS)), min_size=1, max_size=3, unique=True)):
            body[name] = draw(CHAT_FIELDS[name][1])
    if draw(st.integers(0, 7)) == 0:
        del body["messages"]
    return body


def encode_body(body, ascii_only: bool) -> bytes:
    # allow_nan writes NaN / Infinity literals, which some parsers accept and JSON does not.
    text = json.dumps(body, allow_nan=True, ensure_ascii=ascii_only)
    # A lone surrogate cannot be UTF-8; surrogatepass writes its three bytes anyway: invalid UTF-8.
    return text.encode("utf-8", "surrogatepass")


def _corrupt(data: bytes, at: int, junk: bytes) -> bytes:
    at = at % (len(data) + 1)
    return data[:at] + junk + data[at:]


raw_bodies = st.one_of(
    st.sampled_from([b"", b"{", b"}", b"not json", b"[]", b"5", b'"x"', b"null", b"true", b"\xff\xfe\x00",
                     b'{"messages": }', b"\xef\xbb\xbf{}", DEEP_ARRAY.encode(), DEEP_OBJECT.encode(),
                     b'{"messages": ' + DEEP_ARRAY.encode() + b"}",
                     b'{"messages": [{"role": "user", "content": "hi"}], "stop": ' + DEEP_ARRAY.encode() + b"}",
                     '{"messages": [{"role": "user", "content": "hi"}]}'.encode("utf-16"),
                     b'{"messages": [{"role": "user", "content": "hi\xff\xfe"}]}',
                     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
                     b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1' + b"0" * 5000 + b"}",
                     b'{"messages": 5, "messages": [{"role": "user", "content": "hi"}]}']),
    st.binary(max_size=64),
    st.builds(_corrupt, st.builds(encode_body, chat_bodies(), st.just(True)), st.integers(0, 10**6),
              st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80", b"}", b'"'])),
    # Over the server's 64 KiB body limit (see the test's server flags).
    st.builds(lambda n: encode_body({"messages": [{"role": "user", "content": "a" * n}]}, True),
              st.integers(70_000, 200_000)),
)


class HttpCase:
    """One POST /v1/chat/completions: the body's bytes, a Content-Type, and how the client reads.

    read_mode: "read" the whole response, or go away after the response headers or at once
    ("drop_*"), with a FIN or a RST.
    """

    def __init__(self, body: bytes, content_type: str | None, read_mode: str) -> None:
        self.body = body
        self.content_type = content_type
        self.read_mode = read_mode

    def __repr__(self) -> str:  # Hypothesis prints falsifying examples with this: keep it short
        return f"HttpCase(body={_shorten(self.body)}, content_type={self.content_type!r}, read_mode={self.read_mode!r})"


def _shorten(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 400 else f"{shown[:400]}...({len(value)} long)"


json_bodies = st.builds(encode_body, chat_bodies(), st.booleans())
http_cases = st.tuples(
    weighted((3, json_bodies), (1, raw_bodies)),
    st.sampled_from(["application/json", None, "text/plain", "application/json; charset=latin-1"]),
    st.sampled_from(["read", "read", "read", "drop_after_headers_fin", "drop_after_headers_rst", "drop_at_once_rst"]),
).map(lambda args: HttpCase(*args))


# ---- Realtime ------------------------------------------------------------------------------

class Frame:
    """One WebSocket message: a JSON event (the runner adds an event_id if it has none), or raw data."""

    def __init__(self, event: dict | None = None, raw: str | bytes | None = None, binary: bool = False) -> None:
        self.event = event
        self.raw = raw
        self.binary = binary  # send as a binary frame

    @property
    def event_type(self):
        return self.event.get("type") if self.event is not None else None

    @property
    def size(self) -> int:
        """Bytes on the wire, give or take the event_id the runner adds."""
        if self.event is None:
            return len(self.raw.encode() if isinstance(self.raw, str) else self.raw)
        return len(json.dumps(self.event, allow_nan=True)) + 32

    def __repr__(self) -> str:
        return f"Frame({_shorten(self.event if self.event is not None else self.raw)}, binary={self.binary})"


realtime_text_parts = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "text", "output_text"]),
                                            "text": st.sampled_from(SHORT_TEXTS)})
valid_item = st.fixed_dictionaries({"type": st.just("message"), "role": st.sampled_from(["user", "assistant",
                                                                                          "system"]),
                                    "content": st.lists(realtime_text_parts, min_size=1, max_size=2)})
hostile_part = st.fixed_dictionaries({}, optional={
    "type": hostile(st.sampled_from(["input_text", "input_audio", "input_image", "item_reference", "audio", "x"])),
    "text": hostile(st.sampled_from(SHORT_TEXTS + [LONE_SURROGATE])), "audio": json_values,
    "transcript": json_values, "image_url": json_values})
hostile_item = st.one_of(
    st.fixed_dictionaries({}, optional={
        "type": hostile(st.sampled_from(["message", "function_call", "function_call_output", "x"])),
        "role": hostile(st.sampled_from(["user", "assistant", "system", "tool", "developer"])),
        "content": st.one_of(st.lists(hostile_part | realtime_text_parts, max_size=3),
                             st.builds(lambda n: [{"type": "input_text", "text": "a"}] * n, st.integers(100, 3000)),
                             json_values),
        "id": hostile(st.sampled_from(["item_1", "x" * 100, "i" * 10_000])),
        "status": json_values, "call_id": json_values, "output": json_values}),
    json_values)
items = weighted((2, valid_item), (1, hostile_item))

session_fields = {
    "instructions": (st.sampled_from(["", "Be brief."]), hostile(long_text(1000, 30_000, ("a", " x")))),
    "temperature": (st.sampled_from([0, 0.7, 1.0]), number(st.just(-1))),
    "top_p": (st.sampled_from([0.5, 1.0]), number(st.just(0))),
    "seed": (st.integers(-(2**63), 2**63 - 1) | st.none(), count(st.just(0))),
    "max_output_tokens": (st.sampled_from(["inf", 1, 4]), count(st.just(10**6)) | st.sampled_from(["INF", "4"])),
    "max_response_output_tokens": (st.sampled_from(["inf", 2]), count(st.just(0))),
    "output_modalities": (st.just(["text"]), hostile(st.sampled_from([["audio"], [], ["text", "text"], "text",
                                                                        ["text"] * 1000]))),
    "modalities": (st.just(["text"]), hostile(st.just(["audio", "text"]))),
    "voice": (st.just("alloy"), json_values),
    "tools": (st.just([]), json_values),
    "turn_detection": (st.none(), json_values),
    "type": (st.just("realtime"), hostile(st.just("transcription"))),
    "id": (st.just("sess_x"), json_values),
    "model": (st.just("tiny"), json_values),
    "audio": (st.just({"input": {"format": {"type": "audio/pcm", "rate": 24000}}}), json_values),
}


@st.composite
def field_objects(draw, fields: dict) -> dict:
    layer = draw(st.sampled_from(["valid", "some_bad", "all_bad"]))
    side = 1 if layer == "all_bad" else 0
    value = draw(st.fixed_dictionaries({}, optional={name: pair[side] for name, pair in fields.items()}))
    if layer == "some_bad":
        for name in draw(st.lists(st.sampled_from(list(fields)), min_size=1, max_size=2, unique=True)):
            value[name] = draw(fields[name][1])
    return value


response_fields = {
    **{name: session_fields[name] for name in ("instructions", "temperature", "max_output_tokens",
                                               "max_response_output_tokens", "output_modalities", "tools",
                                               "voice", "modalities")},
    "conversation": (st.sampled_from(["none", "auto"]), hostile(st.sampled_from(["None", "conv_1"]))),
    "input": (st.lists(valid_item, min_size=1, max_size=2), hostile(st.lists(items, max_size=3))),
    "metadata": (st.just({"k": "v"}), json_values),
}

AUDIO_CHUNK = base64.b64encode(bytes(480)).decode()


def event(type_: str, **fields) -> st.SearchStrategy:
    """An event of this type with these fields (strategies), each of them sometimes left out."""
    return st.builds(lambda body: Frame({"type": type_, **body}),
                     st.fixed_dictionaries({}, optional=fields))


client_events = st.one_of(
    st.builds(lambda item: Frame({"type": "conversation.item.create", "item": item}), valid_item),
    st.just(Frame({"type": "response.create"})),
    event("session.update", session=field_objects(session_fields) | json_values),
    event("conversation.item.create", item=items, previous_item_id=hostile(st.sampled_from(["root", "item_x"]))),
    event("conversation.item.delete", item_id=hostile(st.sampled_from(["item_x", "", "i" * 1000]))),
    event("conversation.item.truncate", item_id=hostile(st.just("item_x")), content_index=count(st.just(0)),
          audio_end_ms=count(st.just(0))),
    event("conversation.item.retrieve", item_id=hostile(st.just("item_x"))),
    event("response.create", response=field_objects(response_fields) | json_values),
    event("response.cancel", response_id=hostile(st.sampled_from(["resp_x", ""]))),
    event("input_audio_buffer.append", audio=hostile(st.sampled_from([AUDIO_CHUNK, "!!not base64!!", ""])
                                                     | long_text(60_000, 66_000, ("a",)))),
    event("input_audio_buffer.commit"), event("input_audio_buffer.clear"), event("output_audio_buffer.clear"),
    st.builds(lambda t, e: Frame({"type": t, **e}),
              st.sampled_from(["", "x", "response.create ", "RESPONSE.CREATE", "session.updated", "error",
                               "transcription_session.update", "session.created"]) | st.text(max_size=20),
              st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
    st.builds(lambda e, t: Frame({**e, "type": t}), st.dictionaries(st.text(max_size=6), json_values, max_size=2),
              json_values.filter(lambda v: not isinstance(v, str))),
    st.builds(Frame, st.dictionaries(st.text(max_size=6).filter(lambda key: key != "type"), json_values, max_size=3)),
    st.builds(lambda event_id: Frame({"type": "session.update", "session": {}, "event_id": event_id}), json_values),
)

raw_frames = st.one_of(
    st.builds(lambda text: Frame(raw=text), st.text(max_size=40) | st.sampled_from(
        ["", "{", "[]", "5", "null", '"session.update"', "{\"type\": NaN}", DEEP_ARRAY, DEEP_OBJECT,
         '{"type": "session.update", "session": ' + DEEP_ARRAY + "}",
         '{"type": "response.create", "response": {"input": ' + DEEP_ARRAY + "}}",
         '{"type": "session.update", "session": {"temperature": 1e400}}',
         '{"type": "session.update", "session": {"seed": 1' + "0" * 5000 + "}}"])),
    # Binary frames: valid events, random bytes, invalid UTF-8 (fine in a binary frame).
    st.builds(lambda f: Frame(f.event, binary=True), client_events),
    st.builds(lambda data: Frame(raw=data, binary=True), st.binary(max_size=40) | st.just(b"\xff\xfe{\"type\": 1}")),
    # Over the 64 KiB message limit, under the transport's cap (4x): an error, not a close.
    st.builds(lambda n: Frame(raw=json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "a" * n}]}})),
        st.integers(70_000, 200_000)),
)

frames = weighted((3, client_events), (1, raw_frames))
# What goes out back to back before the runner waits for replies: mostly one frame; sometimes
# a response.create with its cancel right behind it, or several frames at once.
create_then_cancel = st.builds(
    lambda create, cancel: [create, cancel],
    st.sampled_from([Frame({"type": "response.create"}),
                     Frame({"type": "response.create", "response": {"conversation": "none",
                                                                    "input": [{"type": "message", "role": "user",
                                                                               "content": [{"type": "input_text",
                                                                                            "text": "hi"}]}]}})]),
    event("response.cancel", response_id=st.sampled_from(["resp_x", ""])))
bursts = weighted((4, st.lists(frames, min_size=1, max_size=1)), (1, st.lists(frames, min_size=2, max_size=4)),
                  (1, create_then_cancel))
# How the connection ends: a close after every response is done; a close at once; a dropped
# TCP connection (no close frame); a frame over the transport's cap (close 1009); a text frame
# that is not UTF-8 (close 1007).
ENDINGS = ["close", "close_now", "abort", "over_transport_cap", "invalid_utf8_text"]


@dataclass(frozen=True)
class RealtimeSequence:
    bursts: list[list[Frame]]
    ending: str

    @property
    def num_frames(self) -> int:
        return sum(len(burst) for burst in self.bursts)


def realtime_sequences(min_frames: int, transport_cap: int) -> st.SearchStrategy:
    """At least `min_frames` messages, each under the transport's cap (going over it is an ending)."""
    under_cap = bursts.filter(lambda burst: all(frame.size < transport_cap for frame in burst))
    return st.builds(RealtimeSequence, st.lists(under_cap, min_size=min_frames, max_size=min_frames + 4),
                     st.sampled_from(ENDINGS))
