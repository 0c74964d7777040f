"""benchmarks/gpu.py on a CPU: its kernel check runs in Triton's interpreter and passes, and
without a GPU the benchmark refuses to start with a message that names what is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.py"
KERNELS = ("write_kv_cache", "paged_decode_attention", "paged_prefill_attention")


def run_script(*args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_tiny_kernel_check_passes_every_kernel_in_the_interpreter():
    result = run_script("--check-only", "--tiny", "--device", "cpu")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    table = [line for line in result.stdout.splitlines() if line.startswith("| check |")]
    for kernel in KERNELS:
        rows = [line for line in table if f"| {kernel} " in line]
        assert rows, f"no check row for {kernel}:\n{output}"
        for row in rows:
            assert re.search(r"\| pass \|$", row), row
    assert not any("FAIL" in line for line in table), output


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_exits_2_naming_the_missing_gpu():
    result = run_script(interpret=False)
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "GPU" in message and "--device cpu" in message, message


def test_cpu_device_without_the_interpreter_says_so():
    result = run_script("--check-only", "--tiny", "--device", "cpu", interpret=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "TRITON_INTERPRET=1" in result.stderr
