"""Building and loading the native CPU kernels (csrc/), one library: the C++ decode stack
(csrc/decode_stack.cpp, decode_stack.py), the native 4-bit product (csrc/int4_product.cpp and its
AVX2 variant, int4.py), exact mode's float32 product (csrc/float32_product.cpp,
float32_linear.py), the decode attention that reads the paged cache in place
(csrc/decode_attention.cpp, native_attention.py), a one-pass RMSNorm (csrc/rms_norm.cpp,
rms_norm.py) and the output layer's rescoring of its top candidates (csrc/rescore_top.cpp,
output_layer.py).

It is compiled here, against the installed torch, on first use (~15-40 s with two cores; g++
and ninja) into $ANTIPHON_CACHE/native, by a child process at a lower priority that a
background thread waits for: until it is ready, and wherever it cannot be built, steps take
the Python forward, which computes the same. A model with 4-bit layers on a CPU with AVX-512
VNNI or AVX2, or with float32 layers on one with AVX-512F, waits for it at load instead
(int4_product_available, float32_product_available: a layer's kernel is chosen once).
Later starts load the built library in well under a second. ANTIPHON_NATIVE_DECODE=0 turns it
off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from workers.cpu import int4
from workers.cpu.float32_linear import Float32Linear
from workers.cpu.features import cpu_flags

logger = logging.getLogger("antiphon")

NATIVE = Path(__file__).resolve().parent / "csrc"
SOURCES = [NATIVE / "decode_stack.cpp", NATIVE / "int4_product.cpp", NATIVE / "int4_product_avx2.cpp",
           NATIVE / "decode_attention.cpp",
           NATIVE / "float32_product.cpp", NATIVE / "rms_norm.cpp", NATIVE / "rescore_top.cpp"]
HEADERS = [NATIVE / "int4_product.h", NATIVE / "int4_product_avx2.h", NATIVE / "decode_attention.h",
           NATIVE / "float32_product.h", NATIVE / "rms_norm.h", NATIVE / "avx512_util.h",
           NATIVE / "product_kinds.def"]
LIBRARY = "antiphon_cpu"
# -ffp-contract=off: the stack's own float arithmetic (the rotary loop) must round each
# product and sum as ATen's separate calls do, or its results would not be bitwise theirs on
# targets whose compilers fuse a * b + c by default. (The source also says so, in a pragma.)
# -fopenmp: at::parallel_for (the 4-bit product's threads) is inlined from ATen's headers and
# runs on OpenMP; the library then uses the libgomp torch has already loaded (same soname).
CFLAGS = ["-O2", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

# Libraries kept in the cache: each source, torch or Python version builds its own; older ones
# go after a build (a process still using one keeps its mapping; its checkout rebuilds).
KEPT_LIBRARIES = 4

# How long loading a model whose layers take a native product waits for the library (a first
# build takes ~15-40 s here), well inside the engine's worker start timeout; past it, torch's
# kernels serve.
NATIVE_BUILD_WAIT_SECONDS = 240
# A build running longer is killed (with its compilers) and counts as failed.
BUILD_TIMEOUT_SECONDS = 900
# What the native 4-bit product needs, as /proc/cpuinfo names the flags: either set
# (int4_product.cpp with AVX-512 VNNI, int4_product_avx2.cpp with AVX2; the same results).
INT4_CPU_FLAGS = ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}, {"avx2", "fma", "f16c"})
# And the native float32 product (float32_product.cpp).
FLOAT32_CPU_FLAGS = ({"avx512f"},)
# The kernels whose use is decided once per process (_native_product_available), by name.
KERNELS = ("int4_product", "float32_product")

_lock = threading.Lock()
_state: dict[str, object] = {"status": "not started"}  # -> "building" -> "ready" | "failed"
_built = threading.Event()


def enabled() -> bool:
    return os.environ.get("ANTIPHON_NATIVE_DECODE", "1") != "0"


def library_path() -> Path:
    """The built library, named by everything it depends on: its source, the flags, this
    torch (its ABI), this Python and the machine's architecture. Another checkout or an
    upgrade builds its own."""
    from engine.checkpoint import cache_dir  # here: the builder process needs no engine imports

    parts = [path.read_bytes() for path in SOURCES + HEADERS]
    parts += [" ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(), sys.version.encode(),
              platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return cache_dir() / "native" / f"{LIBRARY}-{key}.so"


def start_build() -> None:
    """Load the library, compiling it first if needed, on a daemon thread; once per process
    (a no-op after, or when turned off)."""
    if not enabled():
        return
    with _lock:
        if _state["status"] != "not started":
            return
        _state["status"] = "building"
    threading.Thread(target=_build, name="antiphon-native-build", daemon=True).start()


def wait_until_built(timeout: float | None = None) -> bool:
    """Build (if not started) and wait; True when the library is loaded."""
    if not enabled():
        return False
    start_build()
    _built.wait(timeout)
    return is_ready()


def is_ready() -> bool:
    return _state["status"] == "ready"


def int4_product_available(wait: bool = True) -> bool:
    """Whether 4-bit layers use the native product (int4_product.cpp): see _native_product_available."""
    return _native_product_available("int4_product", INT4_CPU_FLAGS, "the 4-bit layers", wait)


def float32_product_available(wait: bool = True) -> bool:
    """Whether exact mode's float32 layers use the native product (float32_product.cpp): see
    _native_product_available."""
    return _native_product_available("float32_product", FLOAT32_CPU_FLAGS, "the float32 layers", wait)


def takes_native_kernels(model: torch.nn.Module) -> bool:
    """Whether `model`'s layers run a native product, 4-bit (int4.py) or exact mode's
    float32 (float32_linear.py). Such a model waited for the library when it loaded, so its
    other parts take their native kernels too (the norms, the output layer's rescoring, the
    decode attention), from the first step on a cold cache as on a warm one. bf16 and int8
    models start before the library is built: they keep torch's norms, rescoring and
    attention for the whole process, whatever the cache's state. (Only their greedy
    candidates' 4-bit copy takes the native kernel if the library is loaded already:
    output_layer._Int4Selector; it picks candidates, whose logits are float32 either way.)"""
    return any(isinstance(module, Float32Linear) or (isinstance(module, int4.Int4Linear) and module.int4.native)
               for module in model.modules())


def rms_norm_available() -> bool:
    """Whether the native RMSNorm (rms_norm.cpp) runs here: see _loaded_now."""
    return _loaded_now("rms_norm")


def rescore_top_available() -> bool:
    """Whether the output layer's native rescoring (rescore_top.cpp) runs here: see _loaded_now."""
    return _loaded_now("rescore_top")


def _loaded_now(kernel: str) -> bool:
    """Whether the native `kernel` (AVX-512F) can serve now: the library is loaded. Callers
    ask once, for a model that takes_native_kernels, and keep the answer, so that a part's
    numbers never switch kernels while it serves."""
    return enabled() and has_any(FLOAT32_CPU_FLAGS) and is_ready() and _kernel_usable(kernel)


def has_any(flag_sets: tuple[set[str], ...]) -> bool:
    """Whether this CPU has every flag of one of `flag_sets`."""
    return any(flags <= cpu_flags() for flags in flag_sets)


def _native_product_available(kernel: str, flag_sets: tuple[set[str], ...], layers: str, wait: bool) -> bool:
    """Whether layers use the native `kernel`: the CPU has one of `flag_sets`, the library loads, and the
    process holds one OpenMP runtime. A layer picks its kernel once, when the model loads, so
    that its numbers never change while it serves; so the first call waits for the build (a
    first start compiles it, once per machine and version), and its answer holds for the
    process. `wait=False` (for parts that may take either kernel, like the greedy candidates'
    copy): the answer already given, else whether the library is loaded now, without waiting
    or deciding."""
    if not enabled():
        return False
    if kernel in _state:
        return bool(_state[kernel])
    if not has_any(flag_sets):
        return False
    if not wait:
        return is_ready() and _kernel_usable(kernel)
    if not is_ready() and not library_path().exists():
        logger.info("%s wait for the native CPU kernels: their kernel is chosen once, at load", layers)
    _state[kernel] = wait_until_built(NATIVE_BUILD_WAIT_SECONDS) and _kernel_usable(kernel)
    return bool(_state[kernel])


def _kernel_usable(kernel: str) -> bool:
    if not getattr(torch.ops.antiphon_cpu, f"{kernel}_supported")():
        return False
    # The library links libgomp by its soname and so shares the one torch loaded; a torch built
    # with another OpenMP runtime would give the kernel threads of its own beside torch's.
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:
        logger.warning("two OpenMP runtimes loaded (%s): the layers use torch's kernels", ", ".join(sorted(runtimes)))
        return False
    return True


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process, one path per file (device and inode)."""
    runtimes: dict[tuple[str, str], str] = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)  # address perms offset device inode path
                if len(fields) < 6:
                    continue
                path = fields[5].strip().removesuffix(" (deleted)")
                if any(name in os.path.basename(path) for name in ("libgomp", "libiomp", "libomp")):
                    runtimes.setdefault((fields[3], fields[4]), path)
    except OSError:
        return set()
    return set(runtimes.values())


def _build() -> None:
    try:
        library = library_path()
        if not library.exists():
            logger.info("compiling the native CPU kernels (C++ decode step, 4-bit and float32 products, decode "
                        "attention, RMSNorm, output rescoring) for this CPU (first start only, ~15-40 s)")
            _run_builder(library)
        try:
            torch.ops.load_library(str(library))
        except OSError:
            # A damaged file (a disk filled mid-copy, say): built again, once.
            library.unlink(missing_ok=True)
            _run_builder(library)
            torch.ops.load_library(str(library))
        _state["status"] = "ready"
        logger.info("native CPU kernels ready (%s)", library.name)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a build error: the Python forward serves
        _state["status"] = "failed"
        _state["error"] = f"{type(exc).__name__}: {exc}"
        logger.warning("native CPU kernels unavailable (%s); decode steps run the Python forward and 4-bit "
                       "layers torch's kernel, slower",
                       str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
    finally:
        _built.set()


def _run_builder(library: Path) -> None:
    """Compile in a child process of its own session, at a lower priority: it finishes and
    installs the library even when this process exits first (a one-shot `antiphon generate`
    on a cold cache), and steps served meanwhile keep most of the CPU."""
    root = Path(__file__).resolve().parents[2]  # the checkout: workers/cpu/ is two below
    code = (f"import os, sys; os.nice(10); sys.path.insert(0, {str(root)!r}); "
            f"from workers.cpu.native_library import build_library; build_library({str(library)!r})")
    env = dict(os.environ)
    # torch finds ninja on PATH: the one pip installed sits beside this interpreter.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    builder = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = builder.communicate(timeout=BUILD_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        # Its session holds ninja and the compilers too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(builder.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            builder.communicate(timeout=30)
        raise RuntimeError(f"building the native CPU kernels took over {BUILD_TIMEOUT_SECONDS} s") from None
    if builder.returncode != 0:
        raise RuntimeError(f"building the native CPU kernels failed:\n{stderr.strip()[-4000:]}")


def build_library(library: str | Path, compile_into=None) -> None:
    """Build `library` unless it exists, one builder at a time across processes (an flock,
    which the kernel releases when its holder dies, so a killed build never blocks the next).
    The build runs in a folder of its own and the library is moved into place in one rename:
    a reader sees no library or a whole one. `compile_into(folder) -> built file`: torch's
    builder by default (tests pass another)."""
    import fcntl

    library = Path(library)
    library.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(library.parent / "build.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built by another process meanwhile
            return
        # Holding the lock, no one else is building: folders left by killed builds go.
        for leftover in library.parent.glob("build-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        folder = library.parent / f"build-{library.stem}-{os.getpid()}"
        folder.mkdir()
        try:
            built = (compile_into or _torch_compile)(folder)
            os.replace(built, library)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        libraries = sorted(library.parent.glob(f"{LIBRARY}-*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in libraries[KEPT_LIBRARIES:]:
            old.unlink(missing_ok=True)
    finally:
        os.close(lock)


def _torch_compile(folder: Path) -> Path:
    from torch.utils.cpp_extension import load

    # Returns the built file's path (and loads it into this short-lived process).
    return Path(load(LIBRARY, [str(path) for path in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                     extra_include_paths=[str(NATIVE)], build_directory=str(folder),
                     is_python_module=False, verbose=False))
