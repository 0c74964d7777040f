"""The front end hands the free memory its C heap keeps back to the system.

What a request frees (a decoded upload, a resampled clip, a 1 MiB body's copies) goes back to
glibc's heap, which keeps it mapped: under a flood of 30 s transcription uploads the front end
grew ~100 MiB that nothing used (benchmarks/mixed_soak.py). The decoder trims when its work
drains (workers/heap.py); the front end's work never drains under steady traffic, so it looks
every few seconds at how much the heap holds free and trims only when that is a lot: a trim
costs milliseconds, off the event loop, and the next burst maps what it needs again.
"""

from __future__ import annotations

import asyncio

from workers import heap

CHECK_EVERY_S = 10.0
# Below this the heap's free memory is the ordinary churn between requests, not worth a trim.
TRIM_ABOVE_FREE_BYTES = 32 << 20


def trim_if_mostly_free(threshold: int = TRIM_ABOVE_FREE_BYTES) -> bool:
    """Trims when the heap holds at least `threshold` free bytes; whether it trimmed."""
    free = heap.free_bytes()
    return free is not None and free >= threshold and heap.trim()


async def trim_while_serving(every_s: float = CHECK_EVERY_S, threshold: int = TRIM_ABOVE_FREE_BYTES) -> None:
    """Runs until cancelled (the server's lifespan owns it)."""
    if heap.free_bytes() is None:
        return  # a C library that cannot say what it holds free (or trim it)
    while True:
        await asyncio.sleep(every_s)
        # mallinfo2 and malloc_trim lock the heap's arenas: off the loop, which keeps serving.
        await asyncio.to_thread(trim_if_mostly_free, threshold)
