"""The front end's side of the decoder: each request's queue of deltas, from `add_request` until
it finishes, fails or is released; releases become aborts, batched by EndedRequests.

A request with items registers them with the encoder first (EncoderClient) and releases them
when it ends. Losing the decoder fails every request in flight; losing the encoder, those with
items.
"""

from __future__ import annotations

import asyncio

from engine import protocol
from frontend.encoder_client import EncoderClient
from frontend.ended_requests import EndedRequests
from frontend.engine_errors import EngineUnavailable


class DecoderClient:
    def __init__(self, workers, ended: EndedRequests, encoder: EncoderClient) -> None:
        self.workers = workers  # the WorkerSupervisor
        self.ended = ended
        self.encoder = encoder
        # One queue per registered request: added by add_request, removed when the request
        # finishes, fails or is released.
        self.queues: dict[str, asyncio.Queue] = {}
        self._on_finished: dict[str, object] = {}
        self.stats = protocol.EngineStatsSnapshot()

    async def add_request(self, request: protocol.EngineRequest, on_finished=None, items=()) -> asyncio.Queue:
        """Registers and sends the request; its deltas arrive on the returned queue.

        `on_finished()` runs once the engine is done with it (finished or failed), whether or
        not the reader has taken the last delta: what the request holds server-wide need not
        wait for a slow reader. `items`: the request's preprocessed images, registered with the
        encoder first (one per placeholder of the request)."""
        # Encode before registering: a request that cannot be encoded leaves nothing behind.
        data = protocol.encode(request)
        # Text needs the decoder alone: a request without items goes on while the encoder
        # (or the talker) restarts; one with items waits for nothing and is refused.
        if not self.workers.serves_text or (items and "encoder" not in self.workers.running):
            raise EngineUnavailable(f"engine unavailable: {self.workers.status}")
        if request.request_id in self.queues:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request.request_id] = queue
        if on_finished is not None:
            self._on_finished[request.request_id] = on_finished
        try:
            if items:
                await self.encoder.register_items(request.request_id, items)
            await self.workers.send("decoder", data)
        except BaseException:
            self.release(request.request_id)
            raise
        return queue

    def release(self, request_id: str) -> None:
        """Forget a request the caller no longer reads: if it is still registered (not finished),
        unregister it and have the decoder abort it. Synchronous and idempotent, so a
        done-callback can call it; the abort leaves shortly after, batched with others."""
        self._on_finished.pop(request_id, None)
        self.encoder.release_items(request_id)
        if self.queues.pop(request_id, None) is None:
            return
        if "decoder" in self.workers.running:
            self.ended.abort(request_id)

    def step_outputs(self, message: protocol.StepOutputs) -> None:
        self.stats = message.stats
        for delta in message.deltas:
            queue = self.queues.get(delta.request_id)
            if queue is None:
                continue  # released by the frontend; the decoder has been told
            queue.put_nowait(delta)
            if delta.finish_reason is not None:
                del self.queues[delta.request_id]
                self._finished(delta.request_id)

    def _finished(self, request_id: str) -> None:
        self.encoder.release_items(request_id)
        callback = self._on_finished.pop(request_id, None)
        if callback is not None:
            callback()

    def lost(self, reason: str) -> None:
        self.ended.aborts.clear()  # the decoder that ran them is gone
        self.fail_in_flight(reason)

    def fail_in_flight(self, message: str, only: set[str] | None = None) -> None:
        for request_id, queue in list(self.queues.items()):
            if only is not None and request_id not in only:
                continue
            queue.put_nowait(protocol.RequestDelta(request_id, [], "error", error=message))
            callback = self._on_finished.pop(request_id, None)
            # A decoder still running (another worker was lost) must stop these too.
            self.release(request_id)
            if callback is not None:
                callback()
