"""The decoder hands the heap memory its steps freed back to the system each time its work
drains (workers/heap.py): after a load its size is what it holds, not its busiest step's peak
(issue 29: the soak's decoder stood ~130 MiB above idle after the load, none of it in use)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from engine import protocol
from engine.config import EngineConfig
from workers import decoder_process, heap

REPO = Path(__file__).resolve().parent.parent


class _Core:
    """Work for the steps listed (True: a step runs; False: the decoder finds none)."""

    def __init__(self, busy: list[bool], events: list[str], on_last_check) -> None:
        self.busy, self.events, self.on_last_check = busy, events, on_last_check
        self.last_step_was_empty = False

    @property
    def has_unfinished_requests(self) -> bool:
        if len(self.busy) == 1:
            self.on_last_check()
        return self.busy.pop(0)

    def step(self):
        self.events.append("step")
        return []

    def close(self) -> None:
        pass


def test_decoder_trims_the_heap_once_each_time_its_work_drains(monkeypatch):
    context = zmq.Context()
    inputs = context.socket(zmq.PUSH)
    port = inputs.bind_to_random_port("tcp://127.0.0.1")
    outputs = context.socket(zmq.PULL)
    output_port = outputs.bind_to_random_port("tcp://127.0.0.1")
    worker = decoder_process.DecoderWorker(EngineConfig(), f"tcp://127.0.0.1:{port}",
                                           f"tcp://127.0.0.1:{output_port}")
    events: list[str] = []
    monkeypatch.setattr(heap, "trim", lambda: events.append("trim") or True)
    monkeypatch.setattr(worker, "_send", lambda deltas: None)
    # Two bursts of steps; the worker stops on the Shutdown sent as it finds the second drained.
    worker.core = _Core([True, True, True, False, True, True, False], events,
                        lambda: inputs.send(protocol.encode(protocol.Shutdown())))
    try:
        worker.run()
    finally:
        worker.close()
        inputs.close(linger=0)
        outputs.close(linger=0)
        context.term()
    assert events == ["step", "step", "step", "trim", "step", "step", "trim"]


# In a process of its own, so that the heap's state is known: blocks of 1 MiB come from the
# heap (the mmap threshold set above them, as glibc sets it itself after a large block is
# freed), all but the last are freed, and the last keeps the free ones from being the heap's top.
TRIM_SCRIPT = r"""
import ctypes, sys
from workers import heap
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
M_MMAP_THRESHOLD = -3
libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)

def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) >> 10

blocks = [libc.malloc(1 << 20) for _ in range(64)]
for block in blocks:
    ctypes.memset(block, 1, 1 << 20)
for block in blocks[:-1]:
    libc.free(block)
before = rss()
print(heap.trim(), before - rss())
"""


def test_heap_trim_returns_the_freed_heap_pages():
    result = subprocess.run([sys.executable, "-c", TRIM_SCRIPT], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    trimmed, returned_mib = result.stdout.split()
    if trimmed != "True":
        pytest.skip("this C library has no malloc_trim")
    assert int(returned_mib) >= 48, f"trim returned {returned_mib} MiB of the 63 freed"
