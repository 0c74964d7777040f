"""The kinds of CPU product (how a linear layer's rows are computed), read from the one
definition the C++ stack is compiled with (csrc/product_kinds.def), so Python's numbering is
the compiler's by construction. Names become UPPER_SNAKE_CASE: NativeInt4 -> NATIVE_INT4."""

from __future__ import annotations

import enum
import re
from pathlib import Path

DEFINITION = Path(__file__).resolve().parent / "csrc" / "product_kinds.def"


def _kinds() -> list[tuple[str, int, bool]]:
    """(NAME, value, is 4-bit) per kind. Every line must be a comment, blank or one kind, and the
    values 0, 1, 2, ... in order: the C++ stack indexes a step's per-kind rows by value (and
    checks the same order at compile time)."""
    kinds = []
    for number, line in enumerate(DEFINITION.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        match = re.fullmatch(r"PRODUCT_KIND\((\w+), (\d+), (true|false)\)", line.strip())
        if match is None:
            raise RuntimeError(f"{DEFINITION}:{number}: not a PRODUCT_KIND(Name, value, true|false) line: {line!r}")
        name, value, four_bit = match.groups()
        kinds.append((re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper(), int(value), four_bit == "true"))
    if [value for _, value, _ in kinds] != list(range(len(kinds))) or not kinds:
        raise RuntimeError(f"{DEFINITION}: kinds must be numbered 0, 1, 2, ... in order")
    return kinds


_KINDS = _kinds()
ProductKind = enum.IntEnum("ProductKind", [(name, value) for name, value, _ in _KINDS])
ProductKind.__doc__ = "A CPU product's kind, numbered as decode_stack.cpp's ProductKind."
_FOUR_BIT = {value for _, value, four_bit in _KINDS if four_bit}
ProductKind.is_int4 = property(lambda kind: int(kind) in _FOUR_BIT)
