"""Requests the front end ended that the workers have not been told of yet: the encoder is to
release their items, the decoder to abort them. One background task tells both, a batch at a
time, so that a burst of releases costs each worker one message, not one per request.
"""

from __future__ import annotations

import asyncio

from engine import protocol
from frontend.engine_errors import EngineUnavailable


class EndedRequests:
    def __init__(self, workers) -> None:
        self.workers = workers  # the WorkerSupervisor: its `send`
        self.releases: list[str] = []  # for the encoder; cleared when it is lost
        self.aborts: list[str] = []  # for the decoder; cleared when it is lost
        # For /metrics: AbortRequests messages sent.
        self.abort_messages_sent = 0
        self._wanted = asyncio.Event()

    def release_items(self, request_id: str) -> None:
        self.releases.append(request_id)
        self._wanted.set()

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        self._wanted.set()

    async def send(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            released, self.releases = self.releases, []
            request_ids, self.aborts = self.aborts, []
            # Aborts first: they free KV blocks and stop work that other requests wait behind,
            # and a slow encoder must not hold them up.
            if request_ids:
                try:
                    await self.workers.send("decoder", protocol.encode(protocol.AbortRequests(request_ids)))
                    self.abort_messages_sent += 1
                except EngineUnavailable:
                    pass  # the decoder is gone, and with it every request it ran
            if released:
                try:
                    await self.workers.send("encoder", protocol.encode(protocol.ReleaseItems(released)))
                except EngineUnavailable:
                    pass  # the encoder is gone, and with it every item it held
