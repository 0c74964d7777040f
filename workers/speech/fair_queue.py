"""Clips waiting for the recognizer, served fairly between the clients that sent them.

First come, first served let one client's flood of 30 s uploads put every other client's
two-second voice turn behind minutes of its audio (the mixed soak's transcription flood: honest
Realtime turns waited ~40 s). Here each client (its tenant and address, as the front end's
fair shares count it) gets an equal share of the recognizer's time while it has clips waiting:
deficit round robin, with a clip's cost the seconds of audio the recognizer runs for it. Each
turn adds one quantum (the longest window) to the client's credit and serves its clips while
their cost fits; what is left carries to its next turn, so clips of any length get equal shares
over a round, and a turn spends less than two quanta. A client that sends a clip joins the end
of the round: it waits for the rest of the turn in service and one turn of each other client
with clips waiting, whatever their backlogs. A client with nothing waiting is forgotten, credit
and all. A clip the consumer calls stale (one that waited past its deadline and is answered
without being recognized) costs its owner nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Callable


class FairQueue:
    """A thread-safe queue of (owner, cost, job) with one consumer: `get` returns the next
    job in the round, FIFO within an owner."""

    def __init__(self, quantum: float = 30.0, *, stale: Callable[[object], bool] | None = None) -> None:
        self.quantum = quantum
        self._stale = stale or (lambda job: False)
        self._ready = threading.Condition()
        # Owners with clips waiting, in round order (the first's turn is on): owner -> its
        # clips as (cost, job), oldest first.
        self._rounds: OrderedDict[str, deque[tuple[float, object]]] = OrderedDict()
        # Seconds each owner with clips waiting may still spend.
        self._credit: dict[str, float] = {}
        self._turn_started = False
        # Whose clip is in service, and what is left of its credit, when that clip was its last
        # waiting one: a clip it sends before the clip is done continues its turn instead of
        # starting a fresh one (it did not wait, so it has no claim to a new turn).
        self._serving: tuple[str, float] | None = None
        self._count = 0
        self._stopped = False

    def put(self, owner: str, cost: float, job) -> None:
        with self._ready:
            if owner not in self._rounds and self._serving is not None and self._serving[0] == owner:
                self._rounds[owner] = deque()
                self._rounds.move_to_end(owner, last=False)
                self._credit[owner], self._turn_started = self._serving[1], True
                self._serving = None
            self._rounds.setdefault(owner, deque()).append((max(cost, 0.0), job))
            self._credit.setdefault(owner, 0.0)
            self._count += 1
            self._ready.notify()

    def get(self):
        """The next job, waiting for one; None once stopped. Calling it says the job taken
        last is done."""
        with self._ready:
            self._serving = None
            while not self._rounds and not self._stopped:
                self._ready.wait()
            if self._stopped:
                return None
            while True:
                owner, clips = next(iter(self._rounds.items()))
                cost, job = clips[0]
                if self._stale(job):
                    cost = 0.0
                    break
                if not self._turn_started:
                    self._credit[owner] += self.quantum
                    self._turn_started = True
                if cost <= self._credit[owner]:
                    break
                self._rounds.move_to_end(owner)  # its turn is spent: the next owner's
                self._turn_started = False
            clips.popleft()
            self._count -= 1
            self._credit[owner] -= cost
            if not clips:
                # Nothing waiting: forgotten, so its next clip joins the end of the round.
                del self._rounds[owner]
                self._serving = (owner, self._credit.pop(owner))
                self._turn_started = False
            return job

    def __len__(self) -> int:
        with self._ready:
            return self._count

    def owners(self) -> int:
        """Owners with clips waiting."""
        with self._ready:
            return len(self._rounds)

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify_all()
