"""The native float32 product (workers/cpu/csrc/float32_product.cpp), exact mode's linear layers
where the CPU has AVX-512F: float32 accuracy against a float64 reference, a
row's result independent of its batch (up to the steps of 256 rows that oneDNN takes) and of
the threads, NaN and infinity as F.linear gives them, bad inputs refused."""

import pytest
import torch
import torch.nn.functional as F

from workers.cpu import native_library
from workers.cpu.float32_linear import Float32Linear, can_tile, tile_weight


@pytest.fixture(scope="module", autouse=True)
def library():
    if not native_library.wait_until_built(timeout=600) or not torch.ops.antiphon_cpu.float32_product_supported():
        pytest.skip("the native float32 product needs the native library and AVX-512F")


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.antiphon_cpu.float32_product(x, tile_weight(weight))


def assert_float32_accurate(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within float32 summation error of the float64 product: a few ulps of sum |x w|."""
    exact = x.double() @ weight.double().t()
    scale = x.double().abs() @ weight.double().abs().t()
    error = (out.double() - exact).abs()
    bound = 4 * torch.finfo(torch.float32).eps * scale * max(1.0, x.shape[1] ** 0.5) + 1e-30
    assert bool((error <= bound).all()), float((error / bound).max())


@pytest.mark.parametrize("inputs", [16, 48, 576, 1536])
@pytest.mark.parametrize("outputs", [8, 24, 200])
def test_the_product_is_float32_accurate(inputs, outputs):
    generator = torch.Generator().manual_seed(inputs * 1000 + outputs)
    weight = torch.randn(outputs, inputs, generator=generator)
    # 300 rows: oneDNN's product on a plain copy of the tiles.
    for rows in (1, 2, 3, 5, 300):
        x = torch.randn(rows, inputs, generator=generator)
        out = product(x, weight)
        assert out.shape == (rows, outputs) and out.dtype == torch.float32
        assert_float32_accurate(out, x, weight)


def test_the_tiled_layout_holds_each_weight_where_the_kernel_reads_it():
    weight = torch.arange(16 * 32, dtype=torch.float32).view(16, 32)
    tiled = tile_weight(weight)
    assert tiled.shape == (2, 2, 8, 16)
    for output, inputs in ((0, 0), (9, 3), (15, 31), (7, 16)):
        assert tiled[output // 8, inputs // 16, output % 8, inputs % 16] == weight[output, inputs]


def test_layers_take_it_only_in_whole_tiles_and_chunks():
    assert can_tile(torch.nn.Linear(32, 24)) and can_tile(torch.nn.Linear(576, 49152))
    # A vocabulary of 32001, inputs of 20: oneDNN's product serves them.
    assert not can_tile(torch.nn.Linear(64, 32001)) and not can_tile(torch.nn.Linear(20, 16))


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads():
    generator = torch.Generator().manual_seed(0)
    # 100 tiles: enough for every thread count below to split them.
    weight = torch.randn(800, 208, generator=generator)
    batch = torch.randn(9, 208, generator=generator)
    threads = torch.get_num_threads()
    alone = torch.cat([product(row.unsqueeze(0), weight) for row in batch])
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in (2, 3, 9):
                assert torch.equal(product(batch[:rows], weight), alone[:rows])
            assert torch.equal(product(batch[4:], weight), alone[4:])
    finally:
        torch.set_num_threads(threads)


def test_nan_and_infinity_come_out_as_f_linear_gives_them():
    weight = torch.randn(16, 48)
    weight[3] = 0.0
    x = torch.randn(3, 48)
    x[0, 5] = float("nan")
    x[1, 33] = float("inf")
    out, reference = product(x, weight), F.linear(x, weight)
    assert torch.equal(out.isnan(), reference.isnan()) and torch.equal(out.isinf(), reference.isinf())
    assert out[0].isnan().all() and out[1, 3].isnan()  # inf * 0
    assert out[2].isfinite().all()  # the other rows are untouched


def test_a_strided_input_gives_what_its_contiguous_copy_gives():
    weight = torch.randn(32, 48)
    x = torch.randn(48, 5).t()
    assert not x.is_contiguous()
    assert torch.equal(product(x, weight), product(x.contiguous(), weight))


def test_empty_inputs_give_empty_or_zero_outputs():
    weight = torch.randn(8, 16)
    assert product(torch.randn(0, 16), weight).shape == (0, 8)
    assert torch.equal(product(torch.randn(2, 0), torch.randn(8, 0)), torch.zeros(2, 8))


def test_bad_inputs_are_refused_with_a_reason():
    tiled = tile_weight(torch.randn(16, 32))
    kernel = torch.ops.antiphon_cpu.float32_product
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.randn(2, 32, dtype=torch.float64), tiled)
    with pytest.raises(RuntimeError, match="inputs"):
        kernel(torch.randn(2, 48), tiled)
    with pytest.raises(RuntimeError, match="inputs"):  # within the last chunk: refused too
        kernel(torch.randn(2, 20), tiled)
    with pytest.raises(RuntimeError, match="rows, inputs"):
        kernel(torch.randn(2, 1, 32), tiled)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.randn(2, 32), tiled.transpose(0, 1))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.randn(2, 32), torch.randn(16, 32))


@pytest.mark.parametrize("bias", [False, True])
def test_the_layer_computes_what_f_linear_computes(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(80, 40, bias=bias)
    layer = Float32Linear(linear)
    x = torch.randn(2, 3, 80)
    out = layer(x)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    # Modeling code reads `weight.shape` and `.dtype`: a stand-in, not a second copy.
    assert layer.weight.shape == (40, 80) and layer.weight.untyped_storage().nbytes() <= 4


def test_the_benchmark_runs_and_prints_its_rows():
    """benchmarks/float32_products.py, whose table the README quotes, still runs (one short pass)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "float32_products.py"
    done = subprocess.run([sys.executable, str(script), "--rows", "1", "3", "--reps", "1", "--layers", "1",
                           "--no-bandwidth"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row[0] for row in rows[1:]] == ["1", "3"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows[1:])
