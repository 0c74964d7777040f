"""The C heap's free memory handed back to the system, when a worker's work drains.

A step's temporaries are sized by the load: its logits and the sampler's copies of them are
rows x vocabulary floats (48 MiB for 256 rows of a 49,152-token vocabulary), its activations
rows x width. glibc raises its mmap threshold to the largest block freed (up to 32 MiB), so
after the first large step such tensors come from the heap, and what they free stays mapped:
a decoder kept its busiest step's peak after the load had gone (the soak's decoder stood
~130 MiB above its idle size after 3 minutes of 300 clients, none of it in use; issue 29).
`trim` returns it; the next burst maps what it needs again (page faults only for the memory
it uses), so the decoder does it once each time its last request ends, not between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


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


def trim() -> bool:
    """Hands the heap's free pages (every arena's) back to the system; False where it cannot."""
    function = _malloc_trim()
    if function is None:
        return False
    function(0)
    return True
