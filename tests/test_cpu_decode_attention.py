"""The native decode attention (workers/native/decode_attention.cpp) reads each row's context
from the paged cache by slot: it agrees with SDPA over the gathered contexts to float32's
precision, a row's result does not depend on its batch, and bad slots or lengths are refused."""

import pytest
import torch
import torch.nn.functional as F

from workers import cpu_decode_attention, native_decode


@pytest.fixture(scope="module", autouse=True)
def library():
    if not native_decode.wait_until_built(timeout=600) or not cpu_decode_attention_supported(64):
        pytest.skip("the native decode attention needs the native library and AVX-512F")


def cpu_decode_attention_supported(head_dim: int) -> bool:
    return bool(torch.ops.antiphon_cpu.decode_attention_supported(head_dim))


def paged_batch(rows: int, heads: int, kv_heads: int, head_dim: int, lengths: list[int], slots: int = 2048,
                seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(slots, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(slots, kv_heads, head_dim, generator=generator)
    width = max(lengths)
    # Each row's context scattered over the cache, as blocks from a free list are; padding
    # slots past a row's length point at slot 0 (the runner's padding).
    context_slots = torch.zeros(rows, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        context_slots[row, :length] = torch.randperm(slots, generator=generator)[:length]
    q = torch.randn(rows, heads, head_dim, generator=generator) * 2
    return q, key_cache, value_cache, context_slots, torch.tensor(lengths)


def reference(q, key_cache, value_cache, context_slots, lengths, scale, dtype=torch.float64):
    rows, width = context_slots.shape
    keys = key_cache[context_slots].to(dtype).transpose(1, 2)  # [rows, kv_heads, width, head_dim]
    values = value_cache[context_slots].to(dtype).transpose(1, 2)
    mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.to(dtype).unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[:, :, 0]


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_it_matches_sdpa_over_the_gathered_contexts(head_dim, heads, kv_heads):
    lengths = [1, 2, 15, 16, 17, 300, 1029]  # around the 16-lane chunks of its softmax
    batch = paged_batch(len(lengths), heads, kv_heads, head_dim, lengths)
    scale = head_dim ** -0.5
    out = cpu_decode_attention.attend(*batch, scale)
    exact = reference(*batch, scale)
    sdpa = reference(*batch, scale, torch.float32)
    # As close to the float64 result as SDPA's float32 is (a few float32 roundings).
    error, sdpa_error = (out.double() - exact).abs().max(), (sdpa.double() - exact).abs().max()
    assert out.shape == (len(lengths), heads, head_dim) and out.dtype == torch.float32
    assert error < max(4 * sdpa_error, 1e-6), (error, sdpa_error)


def test_a_row_computes_the_same_alone_as_in_any_batch():
    lengths = [40, 7, 333, 90]
    q, keys, values, slots, lens = paged_batch(4, 9, 3, 64, lengths)
    batched = cpu_decode_attention.attend(q, keys, values, slots, lens, 0.125)
    for row, length in enumerate(lengths):
        alone = cpu_decode_attention.attend(q[row:row + 1], keys, values, slots[row:row + 1, :length],
                                            lens[row:row + 1], 0.125)
        assert torch.equal(alone, batched[row:row + 1])
    # Whatever the padding slots hold.
    padded = slots.clone()
    padded[0, 40:] = 1234
    assert torch.equal(cpu_decode_attention.attend(q, keys, values, padded, lens, 0.125), batched)


def test_far_apart_scores_and_a_query_of_zeros():
    q, keys, values, slots, lens = paged_batch(2, 2, 1, 64, [50, 50])
    q[0] *= 1000  # scores thousands apart: the largest takes all the weight, no NaN or inf
    q[1] = 0  # equal scores: the mean of the values
    out = cpu_decode_attention.attend(q, keys, values, slots, lens, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, keys, values, slots, lens, 0.125))
    torch.testing.assert_close(out[1, 0], values[slots[1], 0].mean(0), rtol=1e-5, atol=1e-6)


def test_a_strided_query_is_read_as_its_values():
    q, keys, values, slots, lens = paged_batch(3, 4, 2, 64, [5, 9, 12])
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert torch.equal(cpu_decode_attention.attend(strided, keys, values, slots, lens, 0.125),
                       cpu_decode_attention.attend(q, keys, values, slots, lens, 0.125))


def test_bad_slots_lengths_and_shapes_are_refused():
    q, keys, values, slots, lens = paged_batch(2, 4, 2, 64, [5, 9], slots=64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        bad = slots.clone()
        bad[1, 3] = 64
        cpu_decode_attention.attend(q, keys, values, bad, lens, 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):
        bad = slots.clone()
        bad[0, 0] = -1
        cpu_decode_attention.attend(q, keys, values, bad, lens, 0.125)
    for wrong in ([0, 9], [5, 10]):
        with pytest.raises(RuntimeError, match="context length"):
            cpu_decode_attention.attend(q, keys, values, slots, torch.tensor(wrong), 0.125)
    with pytest.raises(RuntimeError, match="cannot share"):
        cpu_decode_attention.attend(q[:, :3], keys, values, slots, lens, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        cpu_decode_attention.attend(q[..., :48], keys[..., :48].contiguous(), values[..., :48].contiguous(), slots,
                                    lens, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_decode_attention.attend(q, keys, values, slots.int(), lens, 0.125)


def test_the_benchmark_runs_and_prints_its_rows():
    """benchmarks/decode_attention.py, whose table the README quotes, still runs (one short pass)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "decode_attention.py"
    done = subprocess.run([sys.executable, str(script), "--rows", "1", "3", "--contexts", "40", "--reps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row[:2] for row in rows[1:]] == [["1", "40"], ["3", "40"]]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows[1:])
