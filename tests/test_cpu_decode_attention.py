"""The native decode attention (workers/cpu/csrc/native_attention.cpp) reads each row's context
from the paged cache through its block table: it agrees with SDPA over the gathered contexts to
float32's precision, the engine's steps give the logits SDPA gives, a row's result does not
depend on its batch, and bad blocks or lengths are refused."""

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from tests.test_lean_decoder import generate_every_kind_of_step
from workers.cpu import native_attention, native_library
from workers.model_runner import ModelRunner


@pytest.fixture(scope="module", autouse=True)
def library():
    if not native_library.wait_until_built(timeout=600) or not cpu_decode_attention_supported(64):
        pytest.skip("the native decode attention needs the native library and AVX-512F")


def cpu_decode_attention_supported(head_dim: int) -> bool:
    return bool(torch.ops.antiphon_cpu.decode_attention_supported(head_dim))


BLOCK = 16


def paged_batch(rows: int, heads: int, kv_heads: int, head_dim: int, lengths: list[int], blocks: int = 256,
                seed: int = 0):
    """Random caches of `blocks` blocks, each row's context on blocks in random order (as a free
    list hands them out) -> (q, key_cache, value_cache, block_tables, context_lens)."""
    generator = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=generator)
    width = -(-max(lengths) // BLOCK)
    tables = torch.zeros(rows, width, dtype=torch.long)  # past a row's length: block 0, never read
    for row, length in enumerate(lengths):
        needed = -(-length // BLOCK)
        tables[row, :needed] = torch.randperm(blocks, generator=generator)[:needed]
    q = torch.randn(rows, heads, head_dim, generator=generator) * 2
    return q, key_cache, value_cache, tables, torch.tensor(lengths)


def attend(q, key_cache, value_cache, tables, lengths, scale):
    return native_attention.attend(q, key_cache, value_cache, tables, lengths, BLOCK, scale)


def slots_of(tables, lengths):
    positions = torch.arange(int(lengths.max()))
    return tables[:, positions // BLOCK] * BLOCK + positions % BLOCK


def reference(q, key_cache, value_cache, tables, lengths, scale, dtype=torch.float64):
    """SDPA over each row's gathered context, padded and masked."""
    slots = slots_of(tables, lengths)
    keys = key_cache[slots].to(dtype).transpose(1, 2)  # [rows, kv_heads, width, head_dim]
    values = value_cache[slots].to(dtype).transpose(1, 2)
    mask = (torch.arange(slots.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.to(dtype).unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[:, :, 0]


@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 96, 128, 256])
# Groups of 3, 1, 8 and 7 heads, and 6 (passes of 4 and 2 where heads are small).
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (14, 2), (12, 2)])
def test_it_matches_sdpa_over_the_gathered_contexts(head_dim, heads, kv_heads):
    # Around the 16 lanes of its softmax and its 256-position partitions (merged after).
    lengths = [1, 2, 15, 16, 17, 256, 257, 300, 1029]
    batch = paged_batch(len(lengths), heads, kv_heads, head_dim, lengths)
    scale = head_dim ** -0.5
    out = attend(*batch, scale)
    exact = reference(*batch, scale)
    sdpa = reference(*batch, scale, torch.float32)
    # As close to the float64 result as SDPA's float32 is (a few float32 roundings).
    error, sdpa_error = (out.double() - exact).abs().max(), (sdpa.double() - exact).abs().max()
    assert out.shape == (len(lengths), heads, head_dim) and out.dtype == torch.float32
    assert error < max(4 * sdpa_error, 1e-6), (error, sdpa_error)


def test_a_row_computes_the_same_alone_as_in_any_batch():
    lengths = [40, 7, 333, 90, 600]
    q, keys, values, tables, lens = paged_batch(5, 9, 3, 64, lengths)
    batched = attend(q, keys, values, tables, lens, 0.125)
    for row, length in enumerate(lengths):
        alone = attend(q[row:row + 1], keys, values, tables[row:row + 1, :-(-length // BLOCK)], lens[row:row + 1],
                       0.125)
        assert torch.equal(alone, batched[row:row + 1])
    # Whatever the table holds past a row's length.
    padded = tables.clone()
    padded[1, 1:] = 77
    assert torch.equal(attend(q, keys, values, padded, lens, 0.125), batched)


def test_far_apart_scores_and_a_query_of_zeros():
    q, keys, values, tables, lens = paged_batch(2, 2, 1, 64, [50, 50])
    q[0] *= 1000  # scores thousands apart: the largest takes all the weight, no NaN or inf
    q[1] = 0  # equal scores: the mean of the values
    out = attend(q, keys, values, tables, lens, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, keys, values, tables, lens, 0.125))
    torch.testing.assert_close(out[1, 0], values[slots_of(tables, lens)[1], 0].mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length", [50, 700])
def test_a_nan_in_the_context_reaches_the_output_as_in_sdpa(length):
    q, keys, values, tables, lens = paged_batch(2, 2, 1, 64, [length, length])
    keys[slots_of(tables, lens)[0, length - 3], 0, 5] = float("nan")
    out = attend(q, keys, values, tables, lens, 0.125)
    sdpa = reference(q, keys, values, tables, lens, 0.125, torch.float32)
    assert out[0].isnan().all() and sdpa[0].isnan().all()
    assert torch.isfinite(out[1]).all()  # the other row is untouched


def test_a_strided_query_is_read_as_its_values():
    q, keys, values, tables, lens = paged_batch(3, 4, 2, 64, [5, 9, 12])
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert torch.equal(attend(strided, keys, values, tables, lens, 0.125), attend(q, keys, values, tables, lens, 0.125))


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_a_bfloat16_cache_is_read_as_its_float32_values(head_dim):
    """A bfloat16 cache (--kv-cache-dtype bfloat16) gives bitwise what a float32 cache of the same
    values gives: its elements are widened exactly, nothing else changes."""
    lengths = [1, 17, 256, 300]
    q, keys, values, tables, lens = paged_batch(len(lengths), 9, 3, head_dim, lengths)
    keys, values = keys.bfloat16(), values.bfloat16()
    out = attend(q, keys, values, tables, lens, 0.125)
    assert torch.equal(out, attend(q, keys.float(), values.float(), tables, lens, 0.125))
    with pytest.raises(RuntimeError, match="one dtype"):
        attend(q, keys, values.float(), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        attend(q, keys.half(), values.half(), tables, lens, 0.125)


def test_bad_blocks_lengths_and_shapes_are_refused():
    q, keys, values, tables, lens = paged_batch(2, 4, 2, 64, [5, 20], blocks=4)
    for block in (4, -1):
        bad = tables.clone()
        bad[1, 1] = block
        with pytest.raises(RuntimeError, match="outside the cache"):
            attend(q, keys, values, bad, lens, 0.125)
    for wrong in ([0, 20], [5, 33]):  # 33 positions need a third block
        with pytest.raises(RuntimeError, match="context length"):
            attend(q, keys, values, tables, torch.tensor(wrong), 0.125)
    with pytest.raises(RuntimeError, match="whole blocks"):
        native_attention.attend(q, keys, values, tables, lens, 24, 0.125)
    with pytest.raises(RuntimeError, match="cannot share"):
        attend(q[:, :3], keys, values, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        attend(q[..., :48], keys[..., :48].contiguous(), values[..., :48].contiguous(), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        attend(q, keys, values, tables.int(), lens, 0.125)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_engine_attends_natively_as_it_does_with_sdpa(tiny_checkpoints, arch, monkeypatch):
    """Every step computed twice, SDPA then the native kernel, on float32 layers (exact mode)
    so that only the attention differs: prefill chunks beside decodes of
    other lengths, prefix-cache hits, 1-12-row decode steps in the C++ stack. The runner's
    block tables and lengths must give the contexts SDPA's slots give (a position more or less
    moves the logits by ~1e-2)."""
    llm = LLM(str(tiny_checkpoints[arch]), num_kv_blocks=256, max_num_batched_tokens=24)
    runner = llm.engine.core.executor.runner
    # Exact mode attends natively where its float32 products are native.
    assert runner.native_attention == native_library.float32_product_available()
    forward = ModelRunner._forward
    steps = []

    def both(self, batch, states):
        self.native_attention = False
        sdpa = forward(self, batch, states)
        self.native_attention = True  # last: its keys and values stay in the cache
        native = forward(self, batch, states)
        steps.append((int(batch.counts.max()), (native - sdpa).abs().max().item() if native.numel() else 0.0))
        return native
    monkeypatch.setattr(ModelRunner, "_forward", both)
    generate_every_kind_of_step(llm)
    # A context over the kernel's 256-position partitions: merged after.
    llm.generate([list(range(5, 305))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert max(difference for _, difference in steps) < 1e-4, steps
    assert {1} < {longest for longest, _ in steps}  # decode steps, and steps with prefill chunks
    assert runner.lean.native is not None  # the C++ stack took the decode steps


def test_the_benchmark_runs_and_prints_its_rows():
    """benchmarks/native_attention.py, whose table the README quotes, still runs (one short pass)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "native_attention.py"
    done = subprocess.run([sys.executable, str(script), "--rows", "1", "3", "--contexts", "40", "--reps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [row[:2] for row in rows[1:]] == [["1", "40"], ["3", "40"]]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows[1:])
