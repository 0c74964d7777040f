"""Admission: how many requests the server holds at once, and each request's claim on it.

A request is admitted before any work is done for it (chat template included), so a flood
of requests costs the server a counter, not CPU. Admitted requests run in the decoder's
batch or wait in its queue (the scheduler takes them as KV blocks allow); past `capacity`
the server answers 429 with Retry-After.

What a request holds (its slot, and once submitted its engine request with its output
queue and KV blocks) is owned by one `RequestLease`. Releasing it is idempotent and is
tied to the owning task's completion with a done-callback, which runs even for a task
cancelled before it ever started, so no code path can skip it.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class AdmissionRefused(Exception):
    """The server holds as many requests as it may; the client should retry later."""

    code = "too_many_requests"

    def __init__(self, capacity: int, retry_after_s: int) -> None:
        super().__init__(f"the server is at its limit of {capacity} admitted requests "
                         f"(running and queued); retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class EngineRequests(Protocol):
    def release(self, request_id: str) -> None:
        """Unregister the request and abort it in the engine if it has not finished."""


class Admission:
    def __init__(self, capacity: int, retry_after_s: int = 1) -> None:
        self.capacity = capacity
        self.retry_after_s = retry_after_s
        self.held = 0
        self.refused = 0

    def admit(self, engine: EngineRequests, request_id: str) -> "RequestLease":
        if self.held >= self.capacity:
            self.refused += 1
            raise AdmissionRefused(self.capacity, self.retry_after_s)
        self.held += 1
        return RequestLease(self, engine, request_id)


class RequestLease:
    """One admitted request's slot and engine request, released exactly once."""

    def __init__(self, admission: Admission, engine: EngineRequests, request_id: str) -> None:
        self._admission = admission
        self._engine = engine
        self.request_id = request_id
        self.released = False

    def bind(self, task: asyncio.Task) -> asyncio.Task:
        """Release when `task` ends, however it ends (also if cancelled before it started)."""
        task.add_done_callback(lambda _: self.release())
        return task

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._admission.held -= 1
        # A no-op for a request that finished or was never submitted.
        self._engine.release(self.request_id)

    def __enter__(self) -> "RequestLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
