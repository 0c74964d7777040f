"""The output layer's native rescoring (workers/cpu/csrc/rescore_top.cpp): each row's highest
approximate logits, in ascending index order, with float32 logits recomputed from the weights."""

import pytest
import torch

from workers.cpu import native_library


@pytest.fixture(scope="module")
def rescore_top():
    if not native_library.wait_until_built(timeout=600) or not native_library.rescore_top_available():
        pytest.skip("the native rescoring needs the native library and AVX-512F")
    return torch.ops.antiphon_cpu.rescore_top


@pytest.mark.parametrize("vocab", [32, 33, 500, 49152])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_it_picks_topks_candidates_and_their_float32_logits(rescore_top, vocab, rows):
    generator = torch.Generator().manual_seed(vocab + rows)
    weight = torch.randn(vocab, 72, generator=generator)  # 72: a last chunk of 8 lanes
    bias = torch.randn(vocab, generator=generator)
    x = torch.randn(rows, 72, generator=generator)
    approximate = x @ weight.t() + torch.randn(rows, vocab, generator=generator) * 0.5
    for b in (None, bias):
        indices, values = rescore_top(approximate, x, weight, b, 32)
        assert indices.dtype == torch.long and indices.shape == values.shape == (rows, 32)
        assert torch.equal(indices, approximate.topk(32, dim=-1).indices.sort(dim=-1).values)
        exact = (x.double().unsqueeze(1) @ weight.double()[indices].transpose(1, 2)).squeeze(1)
        if b is not None:
            exact = exact + b.double()[indices]
        assert torch.allclose(values.double(), exact, rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(rescore_top):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 64, generator=generator)
    x = torch.randn(9, 64, generator=generator)
    approximate = x @ weight.t()
    alone = [rescore_top(approximate[i:i + 1], x[i:i + 1], weight, None, 32) for i in range(9)]
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            indices, values = rescore_top(approximate, x, weight, None, 32)
            assert torch.equal(indices, torch.cat([a[0] for a in alone]))
            assert torch.equal(values, torch.cat([a[1] for a in alone]))
    finally:
        torch.set_num_threads(threads)


def test_ties_at_the_cut_keep_the_earliest_indices_and_nan_rows_stay_in_their_row(rescore_top):
    weight = torch.randn(100, 16)
    x = torch.randn(3, 16)
    approximate = torch.zeros(3, 100)
    approximate[0, 90:] = 1.0  # ten high, then 90 equal: the first 22 of those fill the cut
    approximate[1] = float("nan")
    approximate[2] = torch.arange(100.0)
    indices, values = rescore_top(approximate, x, weight, None, 32)
    assert indices[0].tolist() == list(range(22)) + list(range(90, 100))
    assert indices[1].tolist() == list(range(32))  # all NaN: the first ones, no crash
    assert indices[2].tolist() == list(range(68, 100))
    assert values.isfinite().all()


def test_nan_logits_rank_above_every_number_as_in_topk(rescore_top):
    """A NaN among finite logits (at index 0, where the kept set starts, or later) is kept and
    the rest of the row still competes: the same candidates as torch.topk's."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 16, generator=generator)
    x = torch.randn(3, 16, generator=generator)
    approximate = torch.randn(3, 300, generator=generator)
    approximate[0, 0] = float("nan")
    approximate[1, [5, 100, 299]] = float("nan")
    approximate[2, :40] = float("nan")
    indices, _ = rescore_top(approximate, x, weight, None, 32)
    assert torch.equal(indices[:2], approximate[:2].topk(32, dim=-1).indices.sort(dim=-1).values)
    # More NaNs than places: ties, so the earliest (topk's choice among them is unspecified).
    assert indices[2].tolist() == list(range(32))


def test_bad_inputs_are_refused(rescore_top):
    weight, x, logits = torch.randn(100, 16), torch.randn(2, 16), torch.randn(2, 100)
    for args, message in (((logits.double(), x, weight, None, 8), "float32"),
                          ((logits, x[:1], weight, None, 8), "rows"),
                          ((logits, x, weight[:50], None, 8), "weight"),
                          ((logits, x, weight, torch.randn(99), 8), "bias"),
                          ((logits, x, weight, None, 0), "candidates"),
                          ((logits, x, weight, None, 101), "candidates")):
        with pytest.raises(RuntimeError, match=message):
            rescore_top(*args)
    indices, values = rescore_top(torch.empty(0, 100), torch.empty(0, 16), weight, None, 8)
    assert indices.shape == values.shape == (0, 8)
