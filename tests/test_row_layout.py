"""The row rule (workers/cpu/row_layout.py) and the product kinds' one definition
(workers/cpu/csrc/product_kinds.def), which Python reads and the C++ stack is compiled from."""

import pytest

from workers.cpu import product_kinds
from workers.cpu.product_kinds import ProductKind
from workers.cpu.row_layout import KERNEL_ROW_LIMITS, KernelRowLimits, StepRows
from workers.forward_context import get_forward_context, set_forward_context


def test_the_kinds_are_numbered_in_order_and_two_are_4_bit():
    assert [int(kind) for kind in ProductKind] == list(range(len(ProductKind)))
    assert {kind for kind in ProductKind if kind.is_int4} == {ProductKind.TORCH_INT4, ProductKind.NATIVE_INT4}


@pytest.mark.parametrize("text, problem", [
    ("PRODUCT_KIND(A, 0, true)\nPRODUCT_KIND(B, 2, false)\n", "numbered"),
    ("PRODUCT_KIND(A, 1, true)\nPRODUCT_KIND(B, 0, false)\n", "numbered"),
    ("PRODUCT_KIND(A, 0, true)  // a trailing comment\n", "not a PRODUCT_KIND"),
    ("PRODUCT_KIND(A,0,true)\n", "not a PRODUCT_KIND"),
    ("// only comments\n", "numbered"),
])
def test_a_definition_the_compiler_would_read_otherwise_is_refused(tmp_path, monkeypatch, text, problem):
    """A line Python skipped, or kinds out of order, would make Python's numbering differ from the
    compiler's without a word: refused at import instead."""
    definition = tmp_path / "product_kinds.def"
    definition.write_text(text)
    monkeypatch.setattr(product_kinds, "DEFINITION", definition)
    with pytest.raises(RuntimeError, match=problem):
        product_kinds._kinds()


def test_generated_rows_take_the_kernel_up_to_its_limit_and_prompt_rows_the_copy():
    limits = KernelRowLimits(torch_int4=2, native_int4=4)
    decode = StepRows(tokens=3, limits=limits)  # no prompt token
    assert decode.kernel_rows(3, ProductKind.NATIVE_INT4) == 3
    assert decode.kernel_rows(3, ProductKind.TORCH_INT4) == 0  # past torch's kernel's 2 rows
    mixed = StepRows(tokens=5, generated=2, limits=limits)
    assert mixed.kernel_rows(5, ProductKind.NATIVE_INT4) == 2 and mixed.kernel_rows(5, ProductKind.TORCH_INT4) == 2
    # A product of other rows than the step's (an output layer's sampled rows): all prompt.
    assert mixed.generated_rows(2) == 0 and mixed.kernel_rows(2, ProductKind.NATIVE_INT4) == 0
    assert StepRows(tokens=6, generated=4, limits=limits).kernel_rows(6, ProductKind.NATIVE_INT4) == 4
    # More generated rows than the kernel takes: all of them take the copy.
    assert StepRows(tokens=6, generated=5, limits=limits).kernel_rows(6, ProductKind.NATIVE_INT4) == 0
    # What the C++ stack gets: one entry per kind, the 4-bit ones by the rule.
    by_kind = decode.kernel_rows_by_kind(3)
    assert len(by_kind) == len(ProductKind)
    assert by_kind[ProductKind.NATIVE_INT4] == 3 and by_kind[ProductKind.TORCH_INT4] == 0


def test_outside_a_step_every_row_is_generated_and_the_engines_limits_hold():
    outside = get_forward_context().rows
    assert not outside.computes_prompt and outside.limits == KERNEL_ROW_LIMITS
    assert outside.kernel_rows_by_kind(12)[ProductKind.NATIVE_INT4] == 12
    assert outside.kernel_rows_by_kind(12)[ProductKind.TORCH_INT4] == 0  # past torch's kernel's 8
    with set_forward_context(rows=StepRows(tokens=4, generated=1)):
        assert get_forward_context().rows.computes_prompt and get_forward_context().attention is None
    assert get_forward_context().rows is outside
