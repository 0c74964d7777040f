"""No request field silently ignored: unknown fields and known-but-unsupported ones.

Request structs forbid unknown fields, so a misspelt or unsupported field is a 400
`unsupported_parameter` naming it. With --accept-unknown-fields the body is decoded
leniently instead: fields the struct does not declare are dropped (and logged), at any
depth. Fields of the OpenAI schema that the server knows but does not act on are declared
and refused by `refuse_unsupported` when a client sets them to anything but their no-op value.
"""

from __future__ import annotations

import logging
import re

import msgspec

from frontend.edge_decoding import InvalidInput, decode_json

logger = logging.getLogger("antiphon.frontend")

_UNKNOWN = re.compile(r"^invalid (?P<what>.*): Object contains unknown field `(?P<field>[^`]*)`")


def decode_request(data: bytes, type_, accept_unknown_fields: bool, what: str = "request body"):
    """`data` as `type_`; an unknown field is a 400 naming it, or dropped when accepted."""
    try:
        return decode_json(data, type_, what)
    except InvalidInput as exc:
        match = _UNKNOWN.match(str(exc))
        if match is None:
            raise
        if not accept_unknown_fields:
            param = f"{exc.param}.{match['field']}" if exc.param else match["field"]
            raise InvalidInput(f"unsupported parameter {param!r}: this server does not know it (start it with "
                               "--accept-unknown-fields to ignore such fields)", "unsupported_parameter",
                               param) from None
    raw = decode_json(data, object, what)
    dropped: list[str] = []
    kept = _drop_unknown(raw, msgspec.inspect.type_info(type_), "", dropped)
    # Client-chosen names: a few, each cut short, repr-escaped.
    logger.info("ignored unknown request fields: %s", ", ".join(repr(name[:64]) for name in dropped[:8]))
    try:
        return msgspec.convert(kept, type_)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"invalid {what}: {exc}", "invalid_value") from None


def _drop_unknown(value, info, path: str, dropped: list[str]):
    """`value` without the object keys `info` (a msgspec.inspect type) does not declare."""
    if isinstance(info, msgspec.inspect.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        kept = {}
        for key, item in value.items():
            if key in fields:
                kept[key] = _drop_unknown(item, fields[key], f"{path}.{key}", dropped)
            elif key == info.tag_field:
                kept[key] = item
            else:
                dropped.append(f"{path}.{key}".lstrip("."))
        return kept
    if isinstance(info, (msgspec.inspect.ListType, msgspec.inspect.VarTupleType)) and isinstance(value, list):
        return [_drop_unknown(item, info.item_type, f"{path}[{i}]", dropped) for i, item in enumerate(value)]
    if isinstance(info, msgspec.inspect.UnionType):
        # The struct member of a union (messages' content: a string or a list of parts).
        wanted = msgspec.inspect.StructType if isinstance(value, dict) else msgspec.inspect.ListType
        candidates = [member for member in info.types if isinstance(_unwrapped(member), wanted)]
        # A tagged union (Realtime events): the member its tag names.
        tagged = [member for member in candidates if isinstance(value, dict)
                  and _unwrapped(member).tag_field is not None
                  and value.get(_unwrapped(member).tag_field) == _unwrapped(member).tag]
        for member in tagged or candidates:
            return _drop_unknown(value, member, path, dropped)
        return value
    if isinstance(info, msgspec.inspect.Metadata):
        return _drop_unknown(value, info.type, path, dropped)
    return value


def _unwrapped(info):
    return info.type if isinstance(info, msgspec.inspect.Metadata) else info


def refuse_unsupported(body, no_op_values: dict[str, tuple]) -> None:
    """A 400 for the first field set to something other than its no-op values.

    `no_op_values`: field -> values that ask for nothing this server lacks (None always does)."""
    for name, allowed in no_op_values.items():
        value = getattr(body, name)
        if value is not None and value not in allowed:
            raise InvalidInput(f"{name}={_short(value)} is not supported by this server", "unsupported_parameter",
                               name)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
