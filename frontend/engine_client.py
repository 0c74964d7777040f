"""The frontend's side of the actors: spawns the workers, talks to them over ZeroMQ.

Sockets are ipc:// endpoints in a private (0700) temporary directory, so nothing is
reachable from another host. The frontend binds; workers connect. One task reads every
worker output and routes each request's deltas to that request's queue; another watches
the processes. If the decoder dies, every in-flight request ends with an error, /health
turns unhealthy, and the decoder is restarted (up to `max_restarts` times, then the
server exits non-zero).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import zmq
import zmq.asyncio

from engine import protocol
from engine.config import EngineConfig

logger = logging.getLogger("antiphon.frontend")

WORKER_START_TIMEOUT_S = 600.0


class EngineUnavailable(RuntimeError):
    """The decoder is not running (starting, restarting or failed)."""


class EngineClient:
    def __init__(self, config: EngineConfig, max_restarts: int = 3, on_fatal=None) -> None:
        self.config = config
        self.max_restarts = max_restarts
        self.on_fatal = on_fatal
        self.run_dir = Path(tempfile.mkdtemp(prefix="antiphon-"))
        self.context = zmq.asyncio.Context()
        self.addresses = {name: f"ipc://{self.run_dir}/{name}" for name in ("decoder-in", "encoder-in", "outputs")}
        self.from_workers = self.context.socket(zmq.PULL)
        self.from_workers.bind(self.addresses["outputs"])
        self.to_decoder: zmq.asyncio.Socket | None = None
        self.to_encoder: zmq.asyncio.Socket | None = None
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = protocol.EngineStatsSnapshot()
        self.ready: dict[str, protocol.WorkerReady] = {}
        self.status = "starting"
        self.restarts = 0
        self._ready_events: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._read_outputs(), name="worker-outputs"))
        await asyncio.gather(self._spawn("encoder"), self._spawn("decoder"))
        self.status = "ready"

    async def _spawn(self, worker: str) -> None:
        socket = self.context.socket(zmq.PUSH)
        socket.bind(self.addresses[f"{worker}-in"])
        if worker == "decoder":
            self.to_decoder = socket
            args = ["-m", "workers.decoder_process", "--config", json.dumps(asdict(self.config))]
        else:
            self.to_encoder = socket
            args = ["-m", "workers.encoder_process"]
        args += ["--input", self.addresses[f"{worker}-in"], "--output", self.addresses["outputs"]]
        event = self._ready_events[worker] = asyncio.Event()
        process = await asyncio.create_subprocess_exec(sys.executable, *args)
        self.processes[worker] = process
        waiter = asyncio.create_task(process.wait())
        ready = asyncio.create_task(event.wait())
        done, _ = await asyncio.wait({waiter, ready}, timeout=WORKER_START_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if ready not in done:
            waiter.cancel()
            raise RuntimeError(f"{worker} process failed to start (exit code {process.returncode})")
        waiter.cancel()
        self._tasks.append(asyncio.create_task(self._watch(worker, process), name=f"watch-{worker}"))
        logger.info("%s ready (pid %d)", worker, process.pid)

    async def _watch(self, worker: str, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if self._closing:
            return
        logger.error("%s process exited with code %s", worker, code)
        self.status = f"{worker} crashed (exit code {code})"
        self._fail_in_flight(f"the {worker} process crashed (exit code {code})")
        socket = self.to_decoder if worker == "decoder" else self.to_encoder
        # Messages queued for the dead process must not reach its successor.
        socket.close(linger=0)
        if self.restarts >= self.max_restarts:
            logger.error("%s crashed %d times; giving up", worker, self.restarts + 1)
            self.status = f"failed: {worker} crashed too often"
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self.restarts += 1
        try:
            await self._spawn(worker)
            self.status = "ready"
        except Exception as exc:
            self.status = f"failed: {exc}"
            if self.on_fatal is not None:
                self.on_fatal()

    async def shutdown(self) -> None:
        self._closing = True
        for socket in (self.to_decoder, self.to_encoder):
            if socket is not None and not socket.closed:
                try:
                    await socket.send(protocol.encode(protocol.Shutdown()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for process in self.processes.values():
            try:
                await asyncio.wait_for(process.wait(), timeout=5)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
        for task in self._tasks:
            task.cancel()
        for socket in (self.to_decoder, self.to_encoder, self.from_workers):
            if socket is not None:
                socket.close(linger=0)
        self.context.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def healthy(self) -> bool:
        return self.status == "ready"

    # ---- requests ---------------------------------------------------------------------

    async def add_request(self, request: protocol.EngineRequest) -> asyncio.Queue:
        if not self.healthy:
            raise EngineUnavailable(f"engine unavailable: {self.status}")
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request.request_id] = queue
        await self.to_decoder.send(protocol.encode(request))
        return queue

    def release(self, request_id: str) -> None:
        """Unregister a request and abort it in the decoder unless it finished (idempotent)."""
        if self.queues.pop(request_id, None) is not None and self.healthy:
            asyncio.ensure_future(self.to_decoder.send(protocol.encode(protocol.AbortRequests([request_id]))))

    async def abort(self, request_ids: list[str]) -> None:
        live = [r for r in request_ids if self.queues.pop(r, None) is not None]
        if live and self.healthy:
            await self.to_decoder.send(protocol.encode(protocol.AbortRequests(live)))

    def _fail_in_flight(self, message: str) -> None:
        for request_id, queue in self.queues.items():
            queue.put_nowait(protocol.RequestDelta(request_id, [], "error", error=message))
        self.queues.clear()

    async def _read_outputs(self) -> None:
        while True:
            message = protocol.decode_output(await self.from_workers.recv())
            if isinstance(message, protocol.StepOutputs):
                self.stats = message.stats
                for delta in message.deltas:
                    queue = self.queues.get(delta.request_id)
                    if queue is None:
                        continue  # aborted by the frontend; the decoder has been told
                    queue.put_nowait(delta)
                    if delta.finish_reason is not None:
                        del self.queues[delta.request_id]
            elif isinstance(message, protocol.WorkerReady):
                self.ready[message.worker] = message
                self._ready_events[message.worker].set()
            elif isinstance(message, protocol.WorkerFailed):
                logger.error("%s reported a failure:\n%s", message.worker, message.message)
