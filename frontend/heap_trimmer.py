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
import logging
import time
from dataclasses import dataclass

from workers import heap

logger = logging.getLogger("antiphon.frontend")

CHECK_EVERY_S = 10.0
# Below this the heap's free memory is the ordinary churn between requests, not worth a trim.
TRIM_ABOVE_FREE_BYTES = 32 << 20
# A heap that holds that much free trims at least this often even when the free count has not
# grown: pages a trim released and a burst used again count as free as before once they are
# freed, though they are resident again.
TRIM_AT_LEAST_EVERY_S = 120.0


@dataclass
class TrimState:
    # What the heap held free after the last trim (or less, when it reused some since).
    baseline: int = 0
    last_trim: float = 0.0


def trim_if_grown(state: TrimState, threshold: int = TRIM_ABOVE_FREE_BYTES,
                  at_least_every_s: float = TRIM_AT_LEAST_EVERY_S) -> bool:
    """Trims when the heap holds at least `threshold` more free bytes than after the last trim,
    or holds `threshold` free and the last trim is `at_least_every_s` old; says whether it did.

    A trim releases free pages (madvise: they stay mapped but no longer resident) and glibc
    still counts them free, so the count after a trim is the mark to grow from: measured
    against zero, the front end would trim every few seconds forever after its first burst."""
    free = heap.free_bytes()
    if free is None:
        return False
    state.baseline = min(state.baseline, free)  # the heap reused some of what was left free
    grown = free - state.baseline >= threshold
    stale = free >= threshold and time.monotonic() - state.last_trim >= at_least_every_s
    if not (grown or stale) or not heap.trim():
        return False
    state.baseline, state.last_trim = heap.free_bytes() or 0, time.monotonic()
    return True


async def trim_while_serving(every_s: float = CHECK_EVERY_S, threshold: int = TRIM_ABOVE_FREE_BYTES) -> None:
    """Runs until cancelled (the server's lifespan owns it)."""
    if heap.free_bytes() is None:
        return  # a C library that cannot say what it holds free (or trim it)
    state = TrimState(last_trim=time.monotonic())
    try:
        while True:
            await asyncio.sleep(every_s)
            # In a worker thread: the loop goes on serving, though an allocation of its own
            # waits for an arena's lock while the trim walks that arena (milliseconds).
            await asyncio.to_thread(trim_if_grown, state, threshold)
    except Exception:
        logger.exception("the heap trimmer stopped; the front end keeps serving without it")
