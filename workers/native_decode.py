"""The decoder layers of CPU decode steps as one C++ call (workers/native/decode_stack.cpp).

The lean forward (lean_decoder.py) makes ~30 torch calls per layer from Python; on a CPU,
for a one-row step of a small model, the interpreter's share of each call is a large part
of the step. The C++ stack makes the same ATen calls in the same order, so the logits stay
bitwise the model's own, without the interpreter between them.

It is compiled here, against the installed torch, on first use (~30 s with two cores; g++
and ninja) into $ANTIPHON_CACHE/native, on a background thread: until it is ready, and
wherever it cannot be built, steps take the Python forward, which computes the same. Later
starts load the built library in well under a second. ANTIPHON_NATIVE_DECODE=0 turns it off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from engine.checkpoint import cache_dir

logger = logging.getLogger("antiphon")

SOURCE = Path(__file__).resolve().parent / "native" / "decode_stack.cpp"
LIBRARY = "antiphon_cpu"
# torch's builder holds a lock file while it compiles; one left by a killed process would make
# every later build wait forever. A build takes well under this.
STALE_LOCK_SECONDS = 600

_lock = threading.Lock()
_state: dict[str, object] = {"status": "not started"}  # -> "building" -> "ready" | "failed"
_built = threading.Event()


def enabled() -> bool:
    return os.environ.get("ANTIPHON_NATIVE_DECODE", "1") != "0"


def build_directory() -> Path:
    # Per torch version: the library links against this torch's ABI.
    return cache_dir() / "native" / f"torch-{torch.__version__.replace('+', '-')}"


def start_build() -> None:
    """Compile and load the library on a daemon thread, once per process (no-op after)."""
    with _lock:
        if _state["status"] != "not started":
            return
        _state["status"] = "building"
    threading.Thread(target=_build, name="antiphon-native-build", daemon=True).start()


def wait_until_built(timeout: float | None = None) -> bool:
    """Build (if not started) and wait; True when the library is loaded."""
    start_build()
    _built.wait(timeout)
    return is_ready()


def is_ready() -> bool:
    return _state["status"] == "ready"


def _build() -> None:
    try:
        from torch.utils.cpp_extension import load

        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        lock = folder / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)
        if not (folder / f"{LIBRARY}.so").exists():
            logger.info("compiling the C++ decode step for this CPU in the background (first start only, ~30 s); "
                        "until it is ready, decode steps run the Python forward")
        # -ffp-contract=off: nothing is computed in this file's own arithmetic, but the rule
        # that results match the Python forward bitwise should not rest on that staying so.
        load(LIBRARY, [str(SOURCE)], extra_cflags=["-O2", "-ffp-contract=off"], build_directory=str(folder),
             is_python_module=False, verbose=False)
        _state["status"] = "ready"
        logger.info("native CPU decode steps ready (%s)", folder)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a build error: the Python forward serves
        _state["status"] = "failed"
        _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        logger.warning("native CPU decode steps unavailable (%s); decode steps run the Python forward, which "
                       "computes the same, slower", _state["error"])
    finally:
        _built.set()


def decode_stack(layers, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], head_dim: int):
    """The C++ stack over `layers` (lean_decoder._Layer) once the library is loaded, or None
    when it is not (yet) or a layer is of a kind it does not compute."""
    if not is_ready():
        return None
    from workers.cpu_int4 import GROUP_SIZE, MAX_INT4_ROWS

    stack = torch.classes.antiphon_cpu.DecodeStack(head_dim, MAX_INT4_ROWS, GROUP_SIZE)
    for layer in layers:
        norms = layer.native_norms
        if norms is None or layer.sliding_window is not None or layer.head_dim != head_dim:
            return None
        key_cache, value_cache = kv_caches[layer.index]
        stack.add_layer(norms[0][0], norms[0][1], norms[1][0], norms[1][1], layer.scaling, key_cache, value_cache)
        for group in layer.groups:
            if group.native_parts is None:
                return None
            stack.add_group()
            for product in group.native_parts:
                stack.add_product(*product)
            if group.fused is not None:
                stack.fuse_group(*group.fused)
    stack.finish()
    return stack
