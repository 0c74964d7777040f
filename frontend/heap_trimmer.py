"""The front end hands the free memory its C heap keeps back to the system.

What a request frees (a decoded upload, a resampled clip, a 1 MiB body's copies) goes back to
glibc's heap, which keeps it mapped: under a flood of 30 s transcription uploads the front end
grew ~100 MiB that nothing used (benchmarks/mixed_soak.py). The decoder trims when its work
drains (workers/heap.py); the front end's work never drains under steady traffic, so it looks
every few seconds at how much the heap holds free and trims only when that is a lot: a trim
costs milliseconds in a worker thread, and the next burst maps what it needs again.
"""

from __future__ import annotations

import asyncio

from workers import heap

CHECK_EVERY_S = 10.0
# Below this the heap's free memory is the ordinary churn between requests, not worth a trim.
TRIM_ABOVE_FREE_BYTES = 32 << 20


def trim_if_grown(baseline: int, threshold: int = TRIM_ABOVE_FREE_BYTES) -> int:
    """Trims when the heap holds at least `threshold` more free bytes than `baseline` (what it
    held free after the last trim); returns the baseline for the next look.

    A trim hands free pages back but glibc still counts them free (they stay in its free
    chunks, unmapped), so the count after a trim is the mark to grow from: measured against
    zero, the front end would trim every few seconds forever after its first big burst."""
    free = heap.free_bytes()
    if free is None:
        return baseline
    if free < baseline:
        return free  # the heap reused some of it: less is free than was left after the last trim
    if free - baseline < threshold or not heap.trim():
        return baseline
    return heap.free_bytes() or 0


async def trim_while_serving(every_s: float = CHECK_EVERY_S, threshold: int = TRIM_ABOVE_FREE_BYTES) -> None:
    """Runs until cancelled (the server's lifespan owns it)."""
    if heap.free_bytes() is None:
        return  # a C library that cannot say what it holds free (or trim it)
    baseline = 0
    while True:
        await asyncio.sleep(every_s)
        # In a worker thread: the loop goes on serving, though an allocation of its own waits
        # for an arena's lock while the trim walks that arena (milliseconds).
        baseline = await asyncio.to_thread(trim_if_grown, baseline, threshold)
