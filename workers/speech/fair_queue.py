"""Clips waiting for the recognizer, served fairly between the clients that sent them.

First come, first served let one client's flood of 30 s uploads put every other client's
two-second voice turn behind minutes of its audio (the mixed soak's transcription flood: honest
Realtime turns waited ~40 s). Here each client (its tenant and address, as the front end's
fair shares count it) gets an equal share of the recognizer's time while it has clips waiting:
start-time fair queueing, with a clip's cost its length in seconds. A client that was idle
starts level with the others, so a new voice turn waits for at most the clip in service and
one clip of each other waiting client, whatever their backlogs.
"""

from __future__ import annotations

import heapq
import itertools
import threading


class FairQueue:
    """A thread-safe queue of (owner, cost, job) with one consumer: `get` returns the waiting
    job with the smallest start tag, FIFO within an owner; the consumer calls it again only
    once the job it took is done (that is how the queue knows the recognizer is idle)."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._waiting: list[tuple[float, int, float, object]] = []  # (start tag, arrival, finish tag, job)
        self._arrivals = itertools.count()
        # Each owner's finish tag: where its next job starts unless the queue has moved past it.
        self._finish: dict[str, float] = {}
        # The queue's clock: the start tag of the job taken last, moved on to its finish tag
        # once it is done (so that the clock follows the work done, even when every job
        # arrives alone and starts at the clock).
        self._virtual_time = 0.0
        self._serving: float | None = None  # the finish tag of the job being worked on
        self._stopped = False

    def put(self, owner: str, cost: float, job) -> None:
        with self._ready:
            if not self._waiting and self._serving is None:
                # The recognizer is idle: everyone is level again (else the tags of clients
                # served long ago would outlive them and count against their next clip).
                self._virtual_time = max([self._virtual_time, *self._finish.values()])
                self._finish.clear()
            start = max(self._virtual_time, self._finish.get(owner, 0.0))
            finish = self._finish[owner] = start + max(cost, 0.0)
            heapq.heappush(self._waiting, (start, next(self._arrivals), finish, job))
            self._ready.notify()

    def get(self):
        """The next job, waiting for one; None once stopped. Calling it says the job taken
        last is done."""
        with self._ready:
            if self._serving is not None:
                self._virtual_time = max(self._virtual_time, self._serving)
                self._serving = None
            while not self._waiting and not self._stopped:
                self._ready.wait()
            if self._stopped:
                return None
            start, _, self._serving, job = heapq.heappop(self._waiting)
            self._virtual_time = max(self._virtual_time, start)
            # An owner whose work ends before now starts level with everyone anyway: forgetting
            # it keeps this map about as small as the set of owners with work in the queue.
            now = self._virtual_time
            self._finish = {owner: finish for owner, finish in self._finish.items() if finish > now}
            return job

    def __len__(self) -> int:
        with self._ready:
            return len(self._waiting)

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify_all()
