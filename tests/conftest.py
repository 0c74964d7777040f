import os

# Triton kernels run in the interpreter on CPU machines; this must be set before any
# @triton.jit decorator runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite is the CPU suite, on a GPU machine too: with a GPU visible, "auto" would put the
# engine on CUDA with interpreted kernels (neither fast nor what CI checks). The GPU is checked
# by benchmarks/gpu.py. ANTIPHON_TEST_CUDA=1 leaves it visible, for whoever wants to try.
if os.environ.get("ANTIPHON_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Parity with transformers is asserted in exact mode; the faster CPU modes (bf16, int8) have
# their own tests (tests/test_cpu_linear.py), which name their mode.
os.environ.setdefault("ANTIPHON_QUANTIZATION", "none")

import pytest  # noqa: E402

from tests.tiny_models import save_multi_eos_checkpoint, save_tiny_checkpoint  # noqa: E402

# Every CPU mode but exact computes in bfloat16 through oneDNN, which some x86 CPUs cannot
# (AVX2 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT): there the server refuses bf16 and int8,
# serves 4-bit layers on a float32 copy (tests/test_cpu_avx2_path.py), and the tests written
# for the bfloat16 copy are skipped. A test needs them when it names one (in
# its name or a parameter) or is listed here.
_BF16_MODE_WORDS = ("bf16", "int4", "int8", "4bit", "packed", "bfloat16_copy")
_NEEDS_BF16_MODES = {"test_cpu_int4.py", "test_cpu_output_layer.py"}
_NEEDS_BF16_MODE_TESTS = {"test_the_runner_marks_where_a_steps_prompt_tokens_begin"}


def _needs_bf16_modes(item) -> bool:
    if item.path.name in _NEEDS_BF16_MODES or item.originalname in _NEEDS_BF16_MODE_TESTS:
        return True
    words = [item.originalname, *(str(v) for v in getattr(getattr(item, "callspec", None), "params", {}).values())]
    return any(word in text for text in words for word in _BF16_MODE_WORDS)


def pytest_collection_modifyitems(config, items):
    from workers.cpu.linear_modes import can_pack_bf16

    if can_pack_bf16():
        return
    skip = pytest.mark.skip(reason="this CPU cannot compute bfloat16 through oneDNN (no AVX-512 BW/VL/DQ or "
                                   "AVX-NE-CONVERT): bf16 and int8 are refused here, and 4-bit layers keep a float32 copy")
    for item in items:
        if _needs_bf16_modes(item):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def native_decode_stack():
    """The C++ decode stack (workers/cpu/native_library.py) built, or loaded from $ANTIPHON_CACHE,
    before any engine starts: every test then runs the step path users run, whatever the
    timing of a background build. If it cannot be built the suite runs the Python forward
    (bitwise the same) and tests/test_lean_decoder.py fails."""
    from workers.cpu import native_library

    native_library.wait_until_built(timeout=900)


@pytest.fixture(autouse=True)
def native_kernel_decisions():
    """The process's native kernel decisions (native_library.int4_product_available and
    float32_product_available) as they were before each test: a test that turns the native
    library off must not decide them for the tests after."""
    from workers.cpu import native_library

    saved = {kernel: native_library._state.get(kernel) for kernel in native_library.KERNELS}
    yield
    for kernel, decision in saved.items():
        if decision is None:
            native_library._state.pop(kernel, None)
        else:
            native_library._state[kernel] = decision


@pytest.fixture(params=["native", "torch"])
def int4_kernel(request, monkeypatch) -> bool:
    """4-bit layers on each kernel (int4.Int4Product); True for the native one."""
    from workers.cpu import int4, native_library

    native = request.param == "native"
    if native and not native_library.int4_product_available():
        pytest.skip("the native 4-bit kernel needs AVX-512 VNNI or AVX2 and the native library")
    monkeypatch.setattr(int4, "native_kernel_available", lambda wait=True: native)
    return native


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: save_tiny_checkpoint(arch, root / arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def tiny_multi_eos(tmp_path_factory):
    """A tiny Llama whose generation_config.json ends on <|im_end|> and <|endoftext|> while its
    tokenizer's EOS is <|endoftext|>; tests.tiny_models.MULTI_EOS_CONVERSATION ends on <|im_end|>."""
    return save_multi_eos_checkpoint(tmp_path_factory.mktemp("tiny-multi-eos") / "llama")


@pytest.fixture(scope="session")
def voice_server(tmp_path_factory):
    """`antiphon serve` with the default model and voice on (Whisper, Piper, Silero), shared by
    the voice tests: three models and three processes take a while to start."""
    from tests.server_harness import ServerProcess

    server = ServerProcess(None, "--max-audio-seconds", "60", "--max-speech-input-chars", "500",
                           "--max-audio-buffer-seconds", "20", "--max-worker-restarts", "5",
                           log_dir=tmp_path_factory.mktemp("voice-logs"), voice=True)
    yield server
    server.stop()
