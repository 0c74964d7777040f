"""The lean CPU forward (workers/cpu/lean_forward.py) and its C++ decode stack
(workers/cpu/native_library.py) give bitwise the logits of the model's own forward, in every CPU
mode, on every kind of step the engine schedules. (Over 500 lines, as one file: every test runs
the same parity harness, both forwards side by side on one model's steps.)"""

import os

import pytest
import torch

from engine import LLM, SamplingParams
from tests.tiny_models import save_tiny_checkpoint
from workers.cpu import decode_stack, int4, linear_modes, native_library, row_layout
from workers.cpu.product_kinds import ProductKind
from workers.cpu.row_layout import KERNEL_ROW_LIMITS, KernelRowLimits, StepRows
from workers.cpu.lean_forward import LeanDecoder, lean_decoder_for
from workers.model_runner import ModelRunner
from workers.paged_attention import decode_attention


@pytest.fixture(scope="module")
def native_stack():
    """The C++ stack, built (or loaded from $ANTIPHON_CACHE) before the tests that use it."""
    if not native_library.enabled():
        pytest.skip("ANTIPHON_NATIVE_DECODE=0 turns the C++ decode stack off")
    assert native_library.wait_until_built(timeout=600), native_library._state


class CountingStack:
    """Stands in for the C++ stack and counts the steps it computes."""

    def __init__(self, stack) -> None:
        self.stack, self.steps, self.in_place, self.native_attention, self.split = stack, 0, 0, 0, 0

    def forward(self, *args):
        *_, context_start, _, context_lens, _, _ = args  # ..., block_tables, context_lens, block_size, kernel_rows
        self.steps += 1
        self.in_place += context_start >= 0  # a lone row's context read in place
        self.native_attention += context_lens is not None  # decode_attention.py
        # Run as one part of its rows per thread (decode_stack.cpp, forward_split).
        split_before = self.stack.split_steps()
        out = self.stack.forward(*args)
        self.split += self.stack.split_steps() - split_before
        return out


def row_parts(stack, lengths: torch.Tensor) -> list[int]:
    """The stack's parts for a decode step of these context lengths, every row a generated token."""
    return stack.row_parts(lengths, StepRows().kernel_rows_by_kind(len(lengths)))


@pytest.fixture
def two_threads():
    """Two intra-op threads whatever this machine has: the stack splits steps by rows between them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen2_with_sliding_layers(tmp_path_factory):
    """Qwen2 with q/k/v biases and a sliding-window layer whose window every context fits."""
    return save_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2-sliding") / "qwen2",
                                use_sliding_window=True, sliding_window=4096, max_window_layers=1)


def run_both_forwards(monkeypatch, llm: LLM, native: bool = False) -> list[tuple[int, bool]]:
    """Every step runs through both forwards; returns (rows computed, logits bitwise equal)
    per step. The KV cache writes are the same values twice when the two agree. `native`:
    the lean forward uses the C++ stack for its decode steps (else never)."""
    runner = llm.engine.core.executor.runner
    assert isinstance(runner.lean, LeanDecoder)
    if native:
        stack = decode_stack.decode_stack(runner.lean.layers, runner.kv_caches)
        assert stack is not None
        runner.lean.native = CountingStack(stack)
    runner.lean._kv_caches = None  # no background swap during the test
    if not native:
        runner.lean.native = None
    steps = []
    lean_forward = ModelRunner._forward

    def both(self, batch, states):
        lean = lean_forward(self, batch, states)
        self.lean, saved = None, self.lean
        try:
            model = lean_forward(self, batch, states)
        finally:
            self.lean = saved
        steps.append((len(batch.input_ids), torch.equal(lean, model)))
        return lean
    monkeypatch.setattr(ModelRunner, "_forward", both)
    return steps


def generate_every_kind_of_step(llm: LLM) -> None:
    shared = list(range(3, 40))
    prompts = [shared + [i, i + 1] for i in range(11)] + [[7, 8, 9]]
    # 12 streams: decode steps above the kernels' row limits (the batched copy), and fewer as they end.
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(12)]
    llm.generate(prompts, params)
    # Again: the shared prefix now comes from the prefix cache.
    llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    # Alone on a fresh prompt: one row whose context is read in place.
    llm.generate([[50, 51, 52]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))


def quantization(mode: str, monkeypatch) -> str:
    """The --quantization of a test mode: "int4" has 4-bit layers on the native kernel where
    this CPU has AVX-512 VNNI (assert_int4_kernel), up to 10 rows so that the 12-stream
    steps take the batched copy and 9-10-row steps tell the two kernels' limits apart;
    "int4-torch" on torch's kernel (up to 8)."""
    if mode == "int4":
        monkeypatch.setattr(row_layout, "KERNEL_ROW_LIMITS", KernelRowLimits(native_int4=10))
    if mode == "int4-torch":
        monkeypatch.setattr(int4, "native_kernel_available", lambda wait=True: False)
        return "int4"
    return mode


def attends_natively(mode: str) -> bool:
    """Whether a mode's decode rows take the native decode attention: where its layers run a
    native product and the CPU has AVX-512F (decode_attention.serves)."""
    return ((mode == "int4" and native_library.int4_product_available()
             and native_library.has_any(native_library.FLOAT32_CPU_FLAGS))
            or (mode == "none" and native_library.float32_product_available()))


def assert_float32_kernel(runner, mode: str) -> None:
    """Exact mode's products run the native float32 product wherever this CPU has it, else oneDNN's."""
    if mode != "none":
        return
    native = native_library.float32_product_available()
    kinds = {part[0] for layer in runner.lean.layers for group in layer.groups for part in group.native_parts}
    assert kinds == {ProductKind.NATIVE_FLOAT32 if native else ProductKind.PACKED_FLOAT32}


def assert_int4_kernel(runner, mode: str) -> None:
    """The 4-bit layers of an "int4" mode run the kernel it names: the native one wherever this
    CPU has it, torch's for "int4-torch"."""
    if not mode.startswith("int4"):
        return
    native = mode == "int4" and native_library.int4_product_available()
    kinds = {part[0] for layer in runner.lean.layers for group in layer.groups for part in group.native_parts
             if part[0] in (ProductKind.TORCH_INT4, ProductKind.NATIVE_INT4)}
    assert kinds == {ProductKind.NATIVE_INT4 if native else ProductKind.TORCH_INT4}


@pytest.mark.parametrize("mode", ["none", "bf16", "int4", "int4-torch", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_forward_gives_the_models_logits_bitwise(tiny_checkpoints, arch, mode, monkeypatch):
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    # Chunks of at most 24 tokens: prefill chunks resume over cached keys.
    llm = LLM(str(tiny_checkpoints[arch]), quantization=quantization(mode, monkeypatch), num_kv_blocks=256,
              max_num_batched_tokens=24)
    runner = llm.engine.core.executor.runner
    assert_int4_kernel(runner, mode)
    assert_float32_kernel(runner, mode)
    # Where the layers' products are native, both forwards attend with the native decode attention.
    assert runner.native_attention == attends_natively(mode)
    steps = run_both_forwards(monkeypatch, llm)
    generate_every_kind_of_step(llm)
    assert [rows for rows, equal in steps if not equal] == []
    sizes = {rows for rows, _ in steps}
    assert 1 in sizes and max(sizes) > 8 and len(steps) > 20


def test_exact_mode_mixes_native_and_onednn_products_bitwise(tmp_path, native_stack, two_threads, monkeypatch):
    """An intermediate size of 200 (inputs not in whole chunks of 16): down_proj stays oneDNN's
    while gate/up take the native float32 product; both forwards and the C++ stack agree bitwise."""
    if not native_library.float32_product_available():
        pytest.skip("the native float32 product needs AVX-512F and the native library")
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "llama", intermediate_size=200)
    llm = LLM(str(checkpoint), quantization="none", num_kv_blocks=256, max_num_batched_tokens=24)
    runner = llm.engine.core.executor.runner
    kinds = [[part[0] for part in group.native_parts] for group in runner.lean.layers[0].groups]
    assert kinds[2] == [ProductKind.NATIVE_FLOAT32] * 2 and kinds[3] == [ProductKind.PACKED_FLOAT32]
    steps = run_both_forwards(monkeypatch, llm, native=True)
    generate_every_kind_of_step(llm)
    assert [rows for rows, equal in steps if not equal] == []
    assert runner.lean.native.steps > 20
    # oneDNN's product may compute a row differently in another batch: such a stack never
    # splits a step by rows.
    assert row_parts(runner.lean.native.stack, torch.full((16,), 10)) == [0, 16]


def small_stack(tmp_path, quantization: str, intermediate_size: int = 256):
    """(LLM, its C++ stack) for a small Llama in a mode whose layers run native products: 4-bit
    ("int4", AVX-512 VNNI) or exact ("none", AVX-512F); skips where this CPU lacks them."""
    if quantization == "int4" and not native_library.int4_product_available():
        pytest.skip("the native 4-bit product needs AVX-512 VNNI or AVX2")
    if quantization == "none" and not native_library.float32_product_available():
        pytest.skip("the native float32 product needs AVX-512F")
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "llama", hidden_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=intermediate_size)
    llm = LLM(str(checkpoint), quantization=quantization, num_kv_blocks=64)
    runner = llm.engine.core.executor.runner
    stack = decode_stack.decode_stack(runner.lean.layers, runner.kv_caches)
    assert stack is not None
    return llm, stack


def test_a_decode_step_splits_by_rows_into_parts_of_about_equal_work(tmp_path, native_stack, two_threads):
    """decode_stack.cpp's forward_split: from 8 rows up to the 4-bit kernel's limit, a step
    runs as one part of its rows per thread, of at least 4 rows each (4-bit weights),
    balanced by their contexts' lengths (a row's products weigh ~340 positions of attention)."""
    _, stack = small_stack(tmp_path, "int4")

    def parts(lengths: list[int]) -> list[int]:
        return row_parts(stack, torch.tensor(lengths, dtype=torch.int64))
    assert parts([10] * 16) == [0, 8, 16]
    assert parts([10] * 8) == [0, 4, 8]
    # Fewer rows: each call split between the threads instead.
    assert parts([10] * 7) == [0, 7]
    # Past the 4-bit kernel's rows (512) the products take oneDNN (the bfloat16 copy).
    limit = KERNEL_ROW_LIMITS.native_int4
    assert parts([10] * limit) == [0, limit // 2, limit] and parts([10] * (limit + 1)) == [0, limit + 1]
    # Four rows of 2000 positions outweigh twelve of 10: the balanced bound (13) would leave
    # the second part three rows; it keeps the four it must have.
    assert parts([10] * 12 + [2000] * 4) == [0, 12, 16]
    # Eight rows of 1000 positions, then eight of 10: five long rows weigh about as much as
    # three long and eight short ones.
    assert parts([1000] * 8 + [10] * 8) == [0, 5, 16]
    # One very long row: its part keeps the fewest rows allowed.
    assert parts([5000] + [10] * 15) == [0, 4, 16]
    # On any number of threads: a part per thread once each gets 4 rows; a smaller step splits
    # each call between all the threads instead (parts on some would leave the others idle).
    torch.set_num_threads(3)
    assert parts([10] * 16) == [0, 5, 11, 16] and parts([10] * 11) == [0, 11]
    torch.set_num_threads(4)
    assert parts([10] * 16) == [0, 4, 8, 12, 16] and parts([10] * 15) == [0, 15]
    torch.set_num_threads(1)
    assert parts([10] * 16) == [0, 16]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_four_bit_steps_stay_bitwise_and_split_by_rows_on_one_two_and_four_threads(tmp_path, native_stack, threads,
                                                                                    monkeypatch):
    """The row rule follows the thread count, whatever the machine: a 17-row step runs one part
    per thread on two and on four threads (4 rows each at least) where the decode attention is
    native, and every step's logits stay the model's own on each count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm, _ = small_stack(tmp_path, "int4")
        steps = run_both_forwards(monkeypatch, llm, native=True)
        llm.generate([[5 + i, 6, 7] for i in range(17)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        torch.set_num_threads(saved)
    assert [rows for rows, equal in steps if not equal] == []
    runner = llm.engine.core.executor.runner
    assert 17 in {rows for rows, _ in steps} and runner.lean.native.steps >= 5
    assert (runner.lean.native.split > 0) == (threads > 1 and runner.native_attention)


def test_steps_split_by_rows_only_where_silus_vector_blocks_fall_alike(tmp_path, native_stack, two_threads,
                                                                      monkeypatch):
    """silu over more than ATen's grain (32768 elements) runs in one chunk per thread, each a
    loop of 32-element blocks and a scalar tail whose exp rounds apart; split by rows, each part
    makes one serial call. With an MLP of 4896: 8 rows (39168 elements, chunks of 19584) and 10
    (24480) are whole blocks either way; 9 rows' chunks (22032) end mid-block: not split."""
    llm, stack = small_stack(tmp_path, "int4", intermediate_size=4896)
    assert [len(row_parts(stack, torch.full((rows,), 10))) - 1 for rows in (8, 9, 10)] == [2, 1, 2]
    # Nine streams: their 9-row steps stay whole and give the model's own logits. (Split, 32 of
    # silu's elements a layer would take the other exp, which rounds apart now and then, as it
    # did over 16 x 4864 on three threads; here, on so few, it happens not to.)
    steps = run_both_forwards(monkeypatch, llm, native=True)
    llm.generate([[5 + i, 6, 7] for i in range(9)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [rows for rows, equal in steps if not equal] == []
    assert 9 in {rows for rows, _ in steps} and llm.engine.core.executor.runner.lean.native.split == 0


def test_a_bad_context_length_fails_a_split_step_before_any_cache_write(tmp_path, native_stack, two_threads):
    """forward_split checks the whole step's lengths before either part runs: unsplit, the
    attention's own check stops the step at the first layer; split, the other part would
    otherwise write its rows into every layer's cache first."""
    llm, stack = small_stack(tmp_path, "int4")
    runner = llm.engine.core.executor.runner
    lengths = torch.full((16,), 10)
    assert len(row_parts(stack, lengths)) == 3
    lengths[12] = 0
    caches = [cache for pair in runner.kv_caches for cache in pair]
    before = [cache.clone() for cache in caches]
    with torch.inference_mode(), pytest.raises(RuntimeError, match="context length 0"):
        stack.forward(torch.randn(16, 128), torch.ones(1, 1, 16, 64), torch.zeros(1, 1, 16, 64),
                      torch.arange(16), None, None, -1, torch.zeros(16, 1, dtype=torch.int64), lengths,
                      runner.block_size, StepRows().kernel_rows_by_kind(16))
    assert all(torch.equal(cache, saved) for cache, saved in zip(caches, before))


def test_the_stack_takes_a_decode_steps_4bit_rows_on_the_kernel_all_or_none(tmp_path, native_stack):
    """The stack gets the step's row layout as data (row_layout.StepRows): a layout that would
    put some of a decode step's rows on the kernel and others on the copy, or that has a wrong
    number of entries, is refused before any cache write."""
    llm, stack = small_stack(tmp_path, "int4")
    runner = llm.engine.core.executor.runner
    caches = [cache for pair in runner.kv_caches for cache in pair]
    before = [cache.clone() for cache in caches]
    step = (torch.randn(4, 128), torch.ones(1, 1, 4, 64), torch.zeros(1, 1, 4, 64), torch.arange(4), None, None, -1,
            torch.zeros(4, 1, dtype=torch.int64), torch.full((4,), 3), runner.block_size)
    layout = StepRows().kernel_rows_by_kind(4)
    layout[ProductKind.NATIVE_INT4] = layout[ProductKind.TORCH_INT4] = 2
    with torch.inference_mode(), pytest.raises(RuntimeError, match="all or none"):
        stack.forward(*step, layout)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="one entry per product kind"):
        stack.forward(*step, layout[:-1])
    assert all(torch.equal(cache, saved) for cache, saved in zip(caches, before))


def test_exact_mode_splits_steps_by_rows_from_16_rows(tmp_path, native_stack, two_threads, monkeypatch):
    """Exact mode's float32 weights are 8 times the 4-bit bytes: two threads each reading all of
    them pays from 8 rows a part. Its split steps give the model's own logits."""
    llm, stack = small_stack(tmp_path, "none")
    runner = llm.engine.core.executor.runner
    assert row_parts(stack, torch.full((15,), 10)) == [0, 15]
    assert row_parts(stack, torch.full((16,), 10)) == [0, 8, 16]
    # Up to the float32 product's own limit: it computes a row alike up to 255 rows.
    assert row_parts(stack, torch.full((64,), 10)) == [0, 32, 64]
    steps = run_both_forwards(monkeypatch, llm, native=True)
    llm.generate([[5 + i, 6, 7] for i in range(20)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [rows for rows, equal in steps if not equal] == []
    assert runner.lean.native.split >= 5 and 20 in {rows for rows, _ in steps}


# hidden 128, head_dim 64, outputs in multiples of 64: the 4-bit q/k/v and gate/up products
# run fused. int8 layers are not the C++ stack's (the lean Python forward takes them).
# Llama with every bias on: o_proj and down_proj biases too.
@pytest.mark.parametrize("mode", ["none", "bf16", "int4", "int4-torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-biased"])
def test_native_decode_steps_give_the_models_logits_bitwise(tmp_path, arch, mode, native_stack, two_threads,
                                                            monkeypatch):
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    biases = dict(attention_bias=True, mlp_bias=True, random_biases=True) if arch == "llama-biased" else {}
    checkpoint = save_tiny_checkpoint(arch.split("-")[0], tmp_path / arch, hidden_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=256, **biases)
    llm = LLM(str(checkpoint), quantization=quantization(mode, monkeypatch), num_kv_blocks=256,
              max_num_batched_tokens=24)
    runner = llm.engine.core.executor.runner
    fused = [group.fused is not None for layer in runner.lean.layers for group in (layer.qkv, layer.gate_up)]
    assert all(fused) if mode.startswith("int4") else not any(fused)
    assert_int4_kernel(runner, mode)
    assert_float32_kernel(runner, mode)
    # The library was loaded before the model: its norms are native where its layers are native
    # and the CPU has AVX-512F.
    native_layers = native_library.takes_native_kernels(llm.engine.core.executor.model)
    assert native_layers == (mode == "int4" and native_library.int4_product_available()
                             or mode == "none" and native_library.float32_product_available())
    assert {layer.native_norms[2] for layer in runner.lean.layers} == {native_layers and
                                                                       native_library.rms_norm_available()}
    steps = run_both_forwards(monkeypatch, llm, native=True)
    generate_every_kind_of_step(llm)
    assert [rows for rows, equal in steps if not equal] == []
    # Decode steps of 1 to 12 rows went through the C++ stack (prefill chunks did not): with
    # the native decode attention where the products are native, else SDPA, some reading a
    # lone row's context in place.
    native_attention = attends_natively(mode)
    assert runner.native_attention == native_attention
    if native_attention:
        assert runner.lean.native.native_attention == runner.lean.native.steps > 20
        # 4-bit steps of 8 rows and more (up to the kernel's 10 here) ran split by rows between
        # the two threads, each part on its own: the same logits. (Exact mode's from 16 rows:
        # test_exact_mode_splits_steps_by_rows_from_16_rows.)
        assert (runner.lean.native.split > 0) == (mode == "int4")
    else:
        assert runner.lean.native.steps > 20 and runner.lean.native.in_place > 0
        assert runner.lean.native.native_attention == 0


@pytest.mark.parametrize("mode", ["none", "bf16", "int4", "int4-torch"])
def test_native_decode_steps_over_a_bfloat16_cache_give_the_models_logits_bitwise(tmp_path, mode, native_stack,
                                                                                two_threads, monkeypatch):
    """--kv-cache-dtype bfloat16: the C++ stack rounds its cache writes as the Python forwards'
    .to() does, and both read the cache alike, through the native decode attention (native
    layers) or SDPA over widened contexts (the others)."""
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "llama", hidden_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=256)
    llm = LLM(str(checkpoint), quantization=quantization(mode, monkeypatch), kv_cache_dtype="bfloat16",
              num_kv_blocks=256, max_num_batched_tokens=24)
    runner = llm.engine.core.executor.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16 and runner.native_attention == attends_natively(mode)
    steps = run_both_forwards(monkeypatch, llm, native=True)
    generate_every_kind_of_step(llm)
    assert [rows for rows, equal in steps if not equal] == []
    assert runner.lean.native.steps > 20
    if runner.native_attention:
        assert runner.lean.native.native_attention == runner.lean.native.steps
        # 4-bit steps of 8-10 rows split by rows, over the bfloat16 cache too.
        assert (runner.lean.native.split > 0) == (mode == "int4")
    else:
        assert runner.lean.native.in_place > 0


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("native_norm", [False, True])
def test_native_steps_stay_bitwise_on_one_to_four_threads_and_a_wide_mlp(tmp_path, native_stack, native_norm,
                                                                           threads, monkeypatch):
    """The stack splits a batch's ATen norms between the threads by rows (the native norm, by
    rows of its own); ATen splits a large elementwise call (here silu over 17 x 4864) by
    elements. All must leave the logits the model's own (a silu split by rows did not, on 3
    threads: its exp rounds block tails apart). On two threads the 17-row steps run split by
    rows (forward_split), ATen's norm included, and silu's one call over them would run in two
    chunks that meet mid-row (on a block boundary: 4864 is a multiple of 64)."""
    if native_norm and not (native_library.rms_norm_available() and native_library.float32_product_available()):
        pytest.skip("the native RMSNorm needs AVX-512F")
    if not native_norm:
        monkeypatch.setattr(native_library, "rms_norm_available", lambda: False)
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "wide", hidden_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=4864)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Exact mode: its native products take the native norm where it runs.
        llm = LLM(str(checkpoint), quantization="none", num_kv_blocks=256, max_num_batched_tokens=24)
        steps = run_both_forwards(monkeypatch, llm, native=True)
        llm.generate([[5 + i, 6, 7] for i in range(17)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        torch.set_num_threads(saved)
    assert [rows for rows, equal in steps if not equal] == []
    runner = llm.engine.core.executor.runner
    assert {layer.native_norms[2] for layer in runner.lean.layers} == {native_norm}
    assert runner.lean.native.steps >= 5 and 17 in {rows for rows, _ in steps}
    # (Exact mode's products are native where the CPU has AVX-512F; else oneDNN's, never split.
    # 17 rows give two threads parts of 8 or more; three or four threads would need 24 or 32.)
    assert (runner.lean.native.split > 0) == (threads == 2 and native_library.float32_product_available())


def test_the_engine_takes_the_native_stack_once_it_is_built(tmp_path, native_stack):
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "llama", hidden_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=256)
    llm = LLM(str(checkpoint), num_kv_blocks=64)
    runner = llm.engine.core.executor.runner
    assert runner.lean.native is None and runner.lean._kv_caches is not None  # taken at the next step
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [native] = llm.generate([[5, 6, 7, 8]], params)
    assert runner.lean.native is not None and runner.lean._kv_caches is None
    runner.lean.native = None
    [python] = llm.generate([[5, 6, 7, 8]], params)
    assert native.token_ids == python.token_ids


def test_a_stack_that_fails_to_assemble_leaves_the_python_forward(tiny_llama, native_stack, monkeypatch):
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    runner = llm.engine.core.executor.runner
    assert runner.lean._kv_caches is not None  # the stack would be taken at the next step
    attempts = []

    def broken(*args):
        attempts.append(args)
        raise RuntimeError("simulated")
    monkeypatch.setattr(decode_stack, "decode_stack", broken)
    [output] = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(output.token_ids) == 6 and runner.lean.native is None and runner.lean._kv_caches is None
    assert len(attempts) == 1  # tried once, not at every step


def test_the_library_is_built_in_a_folder_of_its_own_and_moved_into_place(tmp_path):
    library = tmp_path / "native" / "antiphon_cpu-test.so"
    leftover = tmp_path / "native" / "build-antiphon_cpu-test-1"  # from a killed build
    leftover.mkdir(parents=True)
    old_libraries = [tmp_path / "native" / f"antiphon_cpu-old{i}.so" for i in range(native_library.KEPT_LIBRARIES)]
    for age, old in enumerate(old_libraries, start=1):
        old.write_bytes(b"old")
        os.utime(old, (1e9 - age, 1e9 - age))  # old0 is the newest of them
    folders = []

    def fake_compile(folder):
        folders.append(folder)
        (folder / "antiphon_cpu.so").write_bytes(b"built")
        return folder / "antiphon_cpu.so"
    native_library.build_library(library, fake_compile)
    assert library.read_bytes() == b"built" and not leftover.exists() and not folders[0].exists()
    # The new library and the newest older ones stay; the oldest goes.
    assert [old.exists() for old in old_libraries] == [True] * (native_library.KEPT_LIBRARIES - 1) + [False]
    native_library.build_library(library, lambda folder: pytest.fail("built twice"))

    def failing_compile(folder):
        raise RuntimeError("no compiler")
    other = tmp_path / "native" / "antiphon_cpu-other.so"
    with pytest.raises(RuntimeError, match="no compiler"):
        native_library.build_library(other, failing_compile)
    assert not other.exists() and not list(other.parent.glob("build-*"))


def test_int8_layers_never_ask_for_the_stack(tiny_llama, monkeypatch):
    """Nor does their output matrix's 4-bit candidate copy wait for it (it takes torch's
    kernel unless the library is loaded already)."""
    monkeypatch.setattr(linear_modes, "cpu_has_native_bf16", lambda: True)
    monkeypatch.delitem(native_library._state, "int4_product", raising=False)
    monkeypatch.setattr(native_library, "start_build", lambda: pytest.fail("int8 started a build"))
    llm = LLM(str(tiny_llama), quantization="int8", num_kv_blocks=64)
    assert llm.engine.core.executor.runner.lean._kv_caches is None


def test_a_contiguous_context_read_in_place_equals_the_gathered_one():
    torch.manual_seed(0)
    keys, values = torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    q = torch.randn(1, 4, 16)
    slots = torch.arange(20, 45).unsqueeze(0)
    gathered = decode_attention(q, keys, values, slots, None, 0.25)
    assert torch.equal(decode_attention(q, keys, values, slots, None, 0.25, context_start=20), gathered)
    assert not torch.equal(decode_attention(q, keys, values, slots, None, 0.25, context_start=21), gathered)
    with pytest.raises(ValueError, match="one row"):
        decode_attention(q.expand(2, 4, 16), keys, values, slots.expand(2, 25), None, 0.25, context_start=20)


def test_sliding_window_layers_take_the_lean_forward_and_pass_their_window(qwen2_with_sliding_layers, monkeypatch):
    llm = LLM(str(qwen2_with_sliding_layers), num_kv_blocks=64)
    runner = llm.engine.core.executor.runner
    assert [layer.sliding_window for layer in runner.lean.layers] == [None, 4096]
    steps = run_both_forwards(monkeypatch, llm)
    llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert steps and [rows for rows, equal in steps if not equal] == []


def test_without_the_native_stack_decode_steps_take_the_python_forward(tiny_llama, monkeypatch):
    monkeypatch.setenv("ANTIPHON_NATIVE_DECODE", "0")
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    runner = llm.engine.core.executor.runner
    [output] = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(output.token_ids) == 6 and runner.lean.native is None and runner.lean._kv_caches is None


def test_other_models_keep_their_own_forward(tmp_path):
    mistral = save_tiny_checkpoint("mistral", tmp_path / "mistral")
    llm = LLM(str(mistral), num_kv_blocks=64)
    assert llm.engine.core.executor.runner.lean is None
    assert lean_decoder_for(torch.nn.Linear(2, 2)) is None
