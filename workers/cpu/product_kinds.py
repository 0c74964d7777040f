"""The kinds of CPU product (how a linear layer's rows are computed), read from the one
definition the C++ stack is compiled with (csrc/product_kinds.def), so Python's numbering is
the compiler's by construction. Names become UPPER_SNAKE_CASE: NativeInt4 -> NATIVE_INT4."""

from __future__ import annotations

import enum
import re
from pathlib import Path

DEFINITION = Path(__file__).resolve().parent / "csrc" / "product_kinds.def"


def _kinds() -> list[tuple[str, int, bool]]:
    found = re.findall(r"^PRODUCT_KIND\((\w+), (\d+), (true|false)\)$", DEFINITION.read_text(), flags=re.M)
    if not found:
        raise RuntimeError(f"no PRODUCT_KIND lines in {DEFINITION}")
    return [(re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper(), int(value), four_bit == "true")
            for name, value, four_bit in found]


_KINDS = _kinds()
ProductKind = enum.IntEnum("ProductKind", [(name, value) for name, value, _ in _KINDS])
ProductKind.__doc__ = "A CPU product's kind, numbered as decode_stack.cpp's ProductKind."
_FOUR_BIT = {value for _, value, four_bit in _KINDS if four_bit}
ProductKind.is_int4 = property(lambda kind: int(kind) in _FOUR_BIT)
