"""What this CPU can do, as Linux reports it (the CPU modes and the native kernels choose by it)."""

from __future__ import annotations


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "flags:")
    except OSError:
        return set()
    return set(line.split(":", 1)[1].split())
