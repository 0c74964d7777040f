"""How many cores this process may use: what thread counts are split from."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform says; Python 3.13
    counts them itself), else the machine's."""
    counter = getattr(os, "process_cpu_count", None)
    if counter is not None:
        return counter() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
