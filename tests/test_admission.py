"""A request's lease gives its slot and engine request back exactly once, however its task ends,
including a task cancelled before its first step (the Realtime create+cancel case)."""

import asyncio

import pytest

from frontend.admission import Admission, AdmissionRefused


class RecordingEngine:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


async def test_a_task_cancelled_before_its_first_step_releases_its_lease():
    admission, engine = Admission(1), RecordingEngine()
    lease = admission.admit(engine, "r1")
    started = []

    async def respond() -> None:
        started.append(True)
        lease.release()  # never reached: only the binding can release it

    task = lease.bind(asyncio.create_task(respond()))
    task.cancel()  # before the loop ever ran it
    await asyncio.gather(task, return_exceptions=True)

    assert task.cancelled() and started == []
    assert admission.held == 0 and engine.released == ["r1"]
    admission.admit(engine, "r2")  # the slot is free again


async def test_release_is_idempotent_across_its_paths():
    admission, engine = Admission(2), RecordingEngine()
    lease = admission.admit(engine, "r1")
    other = admission.admit(engine, "r2")

    async def respond() -> None:
        lease.release()  # the stream's own release (e.g. the engine finished)
        lease.release()

    task = lease.bind(asyncio.create_task(respond()))
    await task
    with lease:  # and a `with` block around it, as HTTP handlers hold it
        pass

    assert admission.held == 1 and engine.released == ["r1"]
    other.release()
    assert admission.held == 0 and engine.released == ["r1", "r2"]


async def test_a_full_admission_refuses_without_holding_anything():
    admission, engine = Admission(1), RecordingEngine()
    lease = admission.admit(engine, "r1")
    with pytest.raises(AdmissionRefused) as refused:
        admission.admit(engine, "r2")
    assert refused.value.retry_after_s == 1
    assert (admission.held, admission.refused) == (1, 1)
    lease.release()
    assert admission.held == 0
