import os

# Triton kernels run in the interpreter on CPU machines; this must be set before any
# @triton.jit decorator runs.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.tiny_models import save_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: save_tiny_checkpoint(arch, root / arch) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints):
    return tiny_checkpoints["llama"]
