"""The C heap's free memory handed back to the system, when a worker's work drains.

A step's temporaries are sized by the load: its logits and the sampler's copies of them are
rows x vocabulary floats (48 MiB for 256 rows of a 49,152-token vocabulary), its activations
rows x width. glibc raises its mmap threshold to the largest block freed (up to 32 MiB), so
after the first large step such tensors come from the heap, and what they free stays mapped:
a decoder kept its busiest step's peak after the load had gone (the soak's decoder stood
~130 MiB above its idle size after 3 minutes of 300 clients, none of it in use; issue 29).
`trim` returns it; the next burst maps what it needs again (page faults only for the memory
it uses), so the decoder does it once each time its last request ends, not between steps.

The front end never drains under steady traffic, so it asks instead how much free memory the
heap keeps (`free_bytes`) and trims when that is large (frontend/heap_trimmer.py), and it
keeps its threads to few arenas (`limit_arenas`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (2.33+): every field a size_t.
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.argtypes = []
    function.restype = _MallInfo2
    return function


def free_bytes() -> int | None:
    """Bytes the heap holds free (every arena's free chunks), or None where the C library
    cannot say (glibc before 2.33, musl, macOS)."""
    function = _mallinfo2()
    return None if function is None else function().fordblks


# mallopt's parameter number for the arena count (glibc's malloc.h).
_M_ARENA_MAX = -8


def limit_arenas(count: int) -> bool:
    """Caps the heap's arenas for the threads started from now on; False where it cannot.

    glibc gives threads up to 8 arenas per core, each keeping its own free memory: a process
    whose threads take turns with large short-lived buffers (the front end's thread pool
    tokenizing and decoding uploads) keeps a peak per arena instead of one peak."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_ARENA_MAX, count))
    except (OSError, AttributeError):
        return False


def arenas_for_a_front_end() -> int:
    """Arenas for a process that is one event loop and a pool of short thread jobs: a quarter
    of the cores, at least two and at most eight (glibc's own cap, eight per core, keeps a
    peak of free memory in each of dozens of arenas; one arena makes the pool's threads queue)."""
    return min(8, max(2, (os.cpu_count() or 1) // 4))


def limit_arenas_unless_set(count: int) -> bool:
    """`limit_arenas`, unless the operator chose with glibc's MALLOC_ARENA_MAX or its
    glibc.malloc.arena_max tunable (theirs wins)."""
    chosen = "MALLOC_ARENA_MAX" in os.environ or "glibc.malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", "")
    return not chosen and limit_arenas(count)


def trim() -> bool:
    """Hands the heap's free pages (every arena's) back to the system; False where it cannot."""
    function = _malloc_trim()
    if function is None:
        return False
    function(0)
    return True
