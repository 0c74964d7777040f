"""Requests the front end ended that the workers have not been told of yet: the encoder is to
release their items, the decoder to abort them. A background task per worker tells it, a batch
at a time, so that a burst of endings costs each worker one message, not one per request, and
a worker slow to take its messages delays only its own: an encoder that blocks does not keep
the decoder's aborts (and the KV blocks and work they free) waiting.
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
        self._releases_wanted = asyncio.Event()
        self._aborts_wanted = asyncio.Event()

    def release_items(self, request_id: str) -> None:
        self.releases.append(request_id)
        self._releases_wanted.set()

    def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        self._aborts_wanted.set()

    async def send(self) -> None:
        """Runs both workers' senders until cancelled."""
        await asyncio.gather(self._send_aborts(), self._send_releases())

    async def _send_aborts(self) -> None:
        while True:
            await self._aborts_wanted.wait()
            self._aborts_wanted.clear()
            request_ids, self.aborts = self.aborts, []
            if not request_ids:
                continue
            try:
                await self.workers.send("decoder", protocol.encode(protocol.AbortRequests(request_ids)))
            except EngineUnavailable:
                continue  # the decoder is gone, and with it every request it ran
            self.abort_messages_sent += 1

    async def _send_releases(self) -> None:
        while True:
            await self._releases_wanted.wait()
            self._releases_wanted.clear()
            released, self.releases = self.releases, []
            if not released:
                continue
            try:
                await self.workers.send("encoder", protocol.encode(protocol.ReleaseItems(released)))
            except EngineUnavailable:
                pass  # the encoder is gone, and with it every item it held
