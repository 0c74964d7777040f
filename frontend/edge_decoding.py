"""Turning bytes from a client into typed structs, with errors that name the field.

Every HTTP body and Realtime event is decoded here, once, at the edge: handlers only ever
see msgspec structs whose types and bounds are already checked, so a bad field is one
`InvalidInput` (a 400 or an `error` event naming it), never an exception three calls in.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from engine.sampling_params import SEED_RANGE

# Integers clients may send for sizes and counts; far above any real limit, and small
# enough that every later encoding (msgpack, torch) accepts them.
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
# The seeds SamplingParams takes, signed or unsigned 64-bit (msgpack carries both; the sampler
# folds each into a generator seed). msgspec bounds cannot go past int64, so the top of the
# range is SamplingParams' check (a 400 / error event naming the seed all the same).
Seed = Annotated[int, msgspec.Meta(ge=SEED_RANGE[0])]
Number = Annotated[float, msgspec.Meta(ge=-1e9, le=1e9)]

_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")


class ContentPart(msgspec.Struct):
    """One part of a message's content; which types a protocol takes is checked by `parts_text`."""

    type: str
    text: str | None = None


def parts_text(parts: list[ContentPart], text_types: tuple[str, ...], param: str) -> str:
    """The text of a message's parts; a part that is not text is refused with a clear error."""
    for part in parts:
        if part.type not in text_types:
            raise InvalidInput(f"content part type {part.type!r} is not supported yet; send text",
                               "unsupported_content_type", param)
        if part.text is None:
            raise InvalidInput("a text content part needs a string 'text'", "invalid_value", param)
    return "".join(part.text for part in parts)


class InvalidInput(ValueError):
    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def decode_json(data: bytes | str, type_, what: str = "request"):
    """Decode JSON into `type_`; raises InvalidInput naming the offending field."""
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        message, param = _split_path(str(exc))
        raise InvalidInput(f"invalid {what}: {message}" + (f" (at {param})" if param else ""),
                           "invalid_value", param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"malformed JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise InvalidInput("JSON nested too deeply", "invalid_json") from None


def _split_path(message: str) -> tuple[str, str | None]:
    match = _PATH.search(message)
    if match is None:
        return message, None
    path = match.group("path").lstrip(".")
    return message[:match.start()], path or None
