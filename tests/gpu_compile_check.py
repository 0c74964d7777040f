"""Every Triton kernel compiled for an H100 (sm_90) on a machine without a GPU, through the launches
its wrapper makes, and checked against what the hardware allows.

The kernel tests run in Triton's interpreter, which never compiles: a kernel the compiler refuses,
one that spills registers, or one that asks for more shared memory than an SM has passes every one
of them. Here each wrapper (write_kv_cache, paged_decode_attention, paged_prefill_attention) is
called with CPU tensors laid out as the engine's are. Triton binds and specialises the arguments
of each launch as it would on an H100 (types, constexprs, num_warps, divisibility), and a
jit_cache_hook takes what it would compile instead of compiling and launching it. Each distinct
launch is then compiled for sm_90; the ptxas -v log of the build gives its registers and spills.

Run from the repository root without TRITON_INTERPRET (the @triton.jit decorators read it at
import): `python -m tests.gpu_compile_check`. Prints a line per compiled kernel; exits 1 if any
fails to compile, spills or needs too much shared memory, and 2 if it cannot compile at all.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: the interpreter's @triton.jit functions cannot be compiled")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.errors import CompilationError

from kernels.cache_write import write_kv_cache
from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention

H100 = GPUTarget("cuda", 90, 32)
# cudaDevAttrMaxSharedMemoryPerBlockOptin of an H100: a launch asking for more fails at load.
H100_MAX_SHARED_BYTES = 232_448
BLOCK_SIZE = 16  # the engine's default KV block size
NUM_KV_HEADS = 2
LAUNCHED_KERNELS = ("_write_kv_cache_kernel", "_decode_split_kernel", "_combine_splits_kernel",
                    "_prefill_attention_kernel")
# The constexprs a wrapper chooses (tiles, split count, dot precision), shown per compile.
SHOWN_CONSTEXPRS = ("BLOCK_H", "BLOCK_G", "BLOCK_M", "BLOCK_Q", "BLOCK_N", "SINGLE_SPLIT", "SPLITS_PAD",
                    "DOT_PRECISION")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# A register or two spilled costs nothing measurable (decode with head sizes 80 and 96 spills 4 B in
# 16-bit caches); a kernel spilling kilobytes runs out of local memory and fails here.
SPILL_TOLERANCE_BYTES = 64
# Measured and accepted, printed as "known", not failed: fp32 caches are for exactness checks, not
# for serving on a GPU, and with head_dim 128 the prefill kernel's fp32 (ieee, no tensor core) dots
# spill ~30 KB whatever its tiles (BLOCK_M 16-64, BLOCK_N 16-32, 4 or 8 warps were tried).
KNOWN_SPILLS = {"prefill fp32 D=128 G=4 max_q=2048"}


class CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: answers the target a launch specialises for, and nothing
    a launch would need (the capture hook stops every launch before it loads or runs a kernel)."""

    def get_current_target(self) -> GPUTarget:
        return H100

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


@dataclass(frozen=True)
class Launch:
    case: str
    kernel: triton.JITFunction
    specialization: str  # Triton's JSON of signature, constexprs, attrs and options


@dataclass(frozen=True)
class Report:
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int

    def problems(self) -> list[str]:
        found = []
        if max(self.spill_stores, self.spill_loads) > SPILL_TOLERANCE_BYTES:
            found.append(f"spills {self.spill_stores} B stores / {self.spill_loads} B loads")
        if self.shared_bytes > H100_MAX_SHARED_BYTES:
            found.append(f"needs {self.shared_bytes} B of shared memory, an H100 has {H100_MAX_SHARED_BYTES}")
        return found


@contextlib.contextmanager
def launches_taken(case: str, into: list[Launch]) -> Iterator[None]:
    """Inside, a kernel launch compiles and runs nothing: what Triton would compile goes to `into`.

    Take every launch before compiling any: Triton asks the hook only about kernels it has not
    compiled in this process, and would try to launch one it has."""

    def take(*, fn, compile, is_manual_warmup, **_) -> bool | None:
        if is_manual_warmup:
            return None
        into.append(Launch(case, fn.jit_function, compile["specialization_data"]))
        return True  # skip the compile and the launch

    triton.knobs.runtime.jit_cache_hook = take
    try:
        yield
    finally:
        triton.knobs.runtime.jit_cache_hook = None


def heads_major(tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, heads, head_dim] as the engine passes q, k and v: a view of [heads, tokens, head_dim]."""
    return torch.empty(heads, tokens, head_dim, dtype=dtype).transpose(0, 1)


def cache_pair(head_dim: int, dtype: torch.dtype, num_kv_heads: int = NUM_KV_HEADS) -> tuple[torch.Tensor, torch.Tensor]:
    num_slots = 4 * BLOCK_SIZE  # only the strides matter: nothing runs
    return (torch.empty(num_slots, num_kv_heads, head_dim, dtype=dtype),
            torch.empty(num_slots, num_kv_heads, head_dim, dtype=dtype))


def cache_write(cache: str, head_dim: int, num_kv_heads: int) -> Callable[[], None]:
    def call() -> None:
        dtype = DTYPES[cache]
        key_cache, value_cache = cache_pair(head_dim, dtype, num_kv_heads)
        key, value = (heads_major(5, num_kv_heads, head_dim, dtype) for _ in range(2))
        write_kv_cache(key, value, key_cache, value_cache, torch.zeros(5, dtype=torch.int64))
    return call


def decode(cache: str, head_dim: int, group: int, batch: int, context: int) -> Callable[[], None]:
    """context: the positions the block tables reach, which (with the batch) sets the split count."""
    def call() -> None:
        dtype = DTYPES[cache]
        key_cache, value_cache = cache_pair(head_dim, dtype)
        query = heads_major(batch, NUM_KV_HEADS * group, head_dim, dtype)
        block_tables = torch.zeros(batch, context // BLOCK_SIZE, dtype=torch.int32)
        context_lens = torch.zeros(batch, dtype=torch.int32)
        paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, head_dim**-0.5, BLOCK_SIZE)
    return call


def prefill(cache: str, head_dim: int, group: int, max_query_len: int) -> Callable[[], None]:
    def call() -> None:
        dtype = DTYPES[cache]
        key_cache, value_cache = cache_pair(head_dim, dtype)
        query = heads_major(max_query_len, NUM_KV_HEADS * group, head_dim, dtype)
        block_tables = torch.zeros(1, triton.cdiv(max_query_len, BLOCK_SIZE), dtype=torch.int32)
        query_start_loc = torch.tensor([0, max_query_len], dtype=torch.int32)
        context_lens = torch.tensor([max_query_len], dtype=torch.int32)
        paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                                max_query_len, head_dim**-0.5, BLOCK_SIZE)
    return call


# Each cache dtype, head_dim 64, 128 and an odd 80, GQA groups 1, 4, 8 (7 for prefill), single- and
# multi-split decode (2, 5, 8, 16 and 64 splits), and every prefill BLOCK_M (16, 64, 128; fp32 caps at 64).
CASES: dict[str, Callable[[], None]] = {
    "write fp16 D=128 Hkv=8": cache_write("fp16", 128, 8),
    "write bf16 D=80 Hkv=2": cache_write("bf16", 80, 2),
    "write fp32 D=128 Hkv=64 (two head blocks)": cache_write("fp32", 128, 64),
    "decode fp16 D=128 G=1 B=32 ctx=128": decode("fp16", 128, 1, 32, 128),
    "decode bf16 D=80 G=4 B=8 ctx=256": decode("bf16", 80, 4, 8, 256),
    "decode bf16 D=128 G=8 B=1 ctx=4096": decode("bf16", 128, 8, 1, 4096),
    "decode fp16 D=64 G=8 B=64 ctx=8192": decode("fp16", 64, 8, 64, 8192),
    "decode fp32 D=128 G=8 B=4 ctx=512": decode("fp32", 128, 8, 4, 512),
    "decode fp32 D=64 G=4 B=1 ctx=32768": decode("fp32", 64, 4, 1, 32768),
    "decode bf16 D=80 G=1 B=2 ctx=2048": decode("bf16", 80, 1, 2, 2048),
    "prefill fp16 D=128 G=1 max_q=1": prefill("fp16", 128, 1, 1),
    "prefill bf16 D=128 G=8 max_q=1": prefill("bf16", 128, 8, 1),
    "prefill fp32 D=64 G=1 max_q=1": prefill("fp32", 64, 1, 1),
    "prefill bf16 D=128 G=1 max_q=64": prefill("bf16", 128, 1, 64),
    "prefill bf16 D=80 G=7 max_q=64": prefill("bf16", 80, 7, 64),
    "prefill bf16 D=128 G=4 max_q=2048": prefill("bf16", 128, 4, 2048),
    "prefill fp16 D=64 G=8 max_q=2048": prefill("fp16", 64, 8, 2048),
    "prefill fp32 D=128 G=4 max_q=2048": prefill("fp32", 128, 4, 2048),
}


def ptxas_report(ptxas_log: str, shared_bytes: int) -> Report:
    registers = re.search(r"Used (\d+) registers", ptxas_log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    if not registers or not spills:
        raise RuntimeError(f"no register or spill counts in the ptxas log:\n{ptxas_log}")
    return Report(int(registers[1]), int(spills[1]), int(spills[2]), shared_bytes)


def compile_for_h100(launch: Launch) -> Report:
    """Compiles as Triton would on an H100, returning what its ptxas -v log and metadata say."""
    log = io.StringIO()
    # Triton prints the ptxas log when asked; on a failure it prints the whole PTX, which the
    # exception's message (ptxas's stderr) makes unnecessary.
    with contextlib.redirect_stdout(log):
        compiled = launch.kernel.preload(launch.specialization)
    return ptxas_report(log.getvalue(), compiled.metadata.shared)


def why_not_compiled(error: Exception) -> str:
    """The innermost of Triton's chained compilation errors, which names the line of the jit
    function that failed and why; other errors (ptxas's, the backend's) as they come."""
    chain: list[BaseException] = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    located = [link for link in chain if isinstance(link, CompilationError)]
    shown = located[-1] if located else error
    return f"{type(shown).__name__}: " + "\n    ".join(str(shown).strip().splitlines()[-12:])


def summary(launch: Launch) -> str:
    """The tile constexprs and launch options the wrapper chose."""
    data = json.loads(launch.specialization)
    constants = dict(zip((tuple(k) for k in data["constant_keys"]), data["constant_vals"]))
    shown = [f"{name}={constants[(i,)]}" for i, name in enumerate(launch.kernel.arg_names)
             if name in SHOWN_CONSTEXPRS and (i,) in constants]
    options = data["options"]
    return f"{' '.join(shown)} warps={options['num_warps']} stages={options['num_stages']}"


def main() -> int:
    if "nvidia" not in triton.backends.backends:
        print(f"cannot compile for sm_90: Triton {triton.__version__} has no nvidia backend")
        return 2
    try:
        ptxas = triton.knobs.nvidia.ptxas
    except RuntimeError as error:
        print(f"cannot compile for sm_90: Triton {triton.__version__} finds no ptxas ({error}); "
              "its wheel ships triton/backends/nvidia/bin/ptxas")
        return 2
    print(f"Triton {triton.__version__}, ptxas {ptxas.version} ({ptxas.path})")
    triton.runtime.driver.set_active(CompileOnlyDriver())
    triton.knobs.nvidia.dump_ptxas_log = True
    launches: list[Launch] = []
    for case, call in CASES.items():
        with launches_taken(case, launches):
            call()
    failures = [f"{case}: no kernel launch captured" for case in CASES
                if not any(launch.case == case for launch in launches)]
    failures += [f"{name}: never launched by any case" for name in LAUNCHED_KERNELS
                 if not any(launch.kernel.__name__ == name for launch in launches)]

    seen: set[str] = set()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache_dir:
        triton.knobs.cache.dir = cache_dir  # a fresh cache: every kernel is built, and logged, here
        for launch in launches:
            if launch.specialization in seen:
                continue
            seen.add(launch.specialization)
            label = f"{launch.kernel.__name__} [{launch.case}] {summary(launch)}"
            began = time.perf_counter()
            try:
                report = compile_for_h100(launch)
            except Exception as error:  # noqa: BLE001 -- the compiler's refusal, whatever its type
                failures.append(f"{label}: does not compile: {why_not_compiled(error)}")
                print(f"FAIL {label}: does not compile ({type(error).__name__})", flush=True)
                continue
            problems = report.problems()
            known = bool(problems) and launch.case in KNOWN_SPILLS and report.shared_bytes <= H100_MAX_SHARED_BYTES
            if not known:
                failures += [f"{label}: {problem}" for problem in problems]
            print(f"{'known' if known else 'FAIL' if problems else 'ok  '} {label}: {report.registers} regs, "
                  f"spill {report.spill_stores}/{report.spill_loads} B, shared {report.shared_bytes} B, "
                  f"{time.perf_counter() - began:.1f} s", flush=True)
    print(f"{len(seen)} kernels compiled for sm_90 in {time.perf_counter() - started:.0f} s, "
          f"{len(failures)} failures")
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
