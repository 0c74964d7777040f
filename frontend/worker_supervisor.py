"""The workers' lifetime: spawns them, reads what they send, watches that each still speaks,
restarts a lost one within its restart budget, and shuts them down.

Sockets are ipc:// endpoints in a private (0700) temporary directory, so nothing is
reachable from another host; started by Ray (a data-parallel replica, frontend/launchers.py),
the front end's sockets are CurveZMQ-authenticated tcp:// ones instead (engine/link_keys.py).
The frontend binds; workers connect. Two background tasks of
its own: one reads every worker output and hands it to `route`, one watches that each worker
still speaks; it starts the clients' tasks beside them and watches those too. Each worker
process also has a task waiting for its exit.

A worker is lost when its process exits or when it sends nothing (no heartbeat, no step
output) for `worker_timeout_s`; a silent one is killed. Either way `on_lost` fails the
requests that needed it, /health turns unhealthy with the reason (losing the talker only
turns voice off: `voice_status` says why), and the worker is restarted, at most
`max_restarts` times per worker in any `restart_window_s`; past that, or if a background task
dies, the supervisor fails for good, calls `on_failed` and then `on_fatal` (the server exits
non-zero).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from engine import protocol
from engine.config import EngineConfig
from engine.worker_sockets import SOCKET_NAMES, worker_flags
from frontend.engine_errors import EngineUnavailable
from frontend.launchers import LocalLauncher
from frontend.restart_budget import RestartBudget

logger = logging.getLogger("antiphon.frontend")

WORKER_START_TIMEOUT_S = 600.0
WORKERS = ("encoder", "decoder")
VOICE_WORKERS = ("encoder", "decoder", "talker")


class WorkerSupervisor:
    def __init__(self, config: EngineConfig, *, max_restarts: int, restart_window_s: float,
                 worker_timeout_s: float, on_fatal, route: Callable[[protocol.WorkerOutput], None],
                 on_lost: Callable[[str, str], None], on_failed: Callable[[str], None], launcher=None) -> None:
        # An idle worker reports every HEARTBEAT_INTERVAL_S; a timeout near that would kill
        # healthy workers for a late beat.
        if worker_timeout_s <= 2 * protocol.HEARTBEAT_INTERVAL_S:
            raise ValueError(f"worker_timeout_s must be more than {2 * protocol.HEARTBEAT_INTERVAL_S:g} s")
        self.config = config
        self.worker_timeout_s = worker_timeout_s
        self.on_fatal = on_fatal
        self.route = route  # every worker message that decodes, in the order read
        self.on_lost = on_lost  # (worker, reason), once per lost process
        self.on_failed = on_failed  # (reason), once, before on_fatal
        self.run_dir = Path(tempfile.mkdtemp(prefix="antiphon-"))
        # The process's one context, never terminated: a context of a supervisor's own, finalised
        # by the garbage collector together with sockets it could no longer close (a supervisor
        # dropped without shutdown, in a reference cycle), blocked in Context.term() and hung the
        # process, whatever the sockets' linger. Its sockets do not linger: nothing waits on a
        # message queued for a worker that is gone, and shutdown closes every one.
        self.context = zmq.asyncio.Context.instance()
        self.context.setsockopt(zmq.LINGER, 0)
        # Where workers reach the front end (local: ipc paths; Ray: authenticated tcp).
        self.launcher = launcher if launcher is not None else LocalLauncher()
        # Worker-to-worker sockets (bound by one worker of the replica, on its machine) stay
        # ipc paths; the front end's own are set as they bind.
        self.addresses = {name: f"ipc://{self.run_dir}/{name}" for name in SOCKET_NAMES}
        self.workers = VOICE_WORKERS if config.voice else WORKERS
        self.from_workers = self._bind(zmq.PULL, "outputs")
        self.to_workers: dict[str, zmq.asyncio.Socket] = {}
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.ready: dict[str, protocol.WorkerReady] = {}
        self.status = "starting"
        self.budgets = {worker: RestartBudget(max_restarts, restart_window_s) for worker in self.workers}
        # For /metrics: restarts since start per worker.
        self.restarts = {worker: 0 for worker in self.workers}
        # Workers that reported ready and have not been lost since.
        self.running: set[str] = set()
        self._last_heard = {worker: 0.0 for worker in self.workers}
        self.voice_status = "ready" if config.voice else "voice is off (--no-voice)"
        # The talker's audio comes back on a socket of its own (read by the talker client).
        self.from_talker = None
        if config.voice:
            self.from_talker = self._bind(zmq.PULL, "speech")
        self._last_read = 0.0
        # Why a worker the watchdog killed is gone (its exit code alone would say "crashed").
        self._lost_reasons: dict[str, str] = {}
        self.failed = False
        self.started = False
        self._ready_events: dict[str, asyncio.Event] = {}
        self.reader: asyncio.Task | None = None
        self._background: list[asyncio.Task] = []
        self._exit_watchers: dict[str, asyncio.Task] = {}
        self._resends: set[asyncio.Future] = set()
        self.closing = False

    def _bind(self, kind: int, name: str) -> zmq.asyncio.Socket:
        """A front-end socket bound where the launcher says (a Curve server on tcp); its
        address (a tcp port is the system's choice) recorded for the workers' flags."""
        socket = self.context.socket(kind)
        if self.launcher.keys is not None:
            self.launcher.keys.serve(socket)
        socket.bind(self.launcher.front_end_address(self.run_dir, name))
        self.addresses[name] = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return socket

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self, background: list[tuple[str, Coroutine]]) -> None:
        """Starts the output reader and the liveness watchdog, then `background` (name,
        coroutine: the clients' own tasks) in that order, then the workers; a background task
        that stops is fatal."""
        self.reader = asyncio.create_task(self._read_outputs(), name="worker-outputs")
        watchdog = asyncio.create_task(self._watch_liveness(), name="worker-watchdog")
        self._background = [self.reader, watchdog, *(asyncio.create_task(coroutine, name=name)
                                                     for name, coroutine in background)]
        for task in self._background:
            task.add_done_callback(self._background_task_ended)
        if self._decoder_measures_gpu_memory():
            # The decoder sizes its KV pool from what the GPU has free once it has loaded: the
            # other workers (the encoder's tower and cache on the same GPU) load first, so the
            # measure counts them instead of racing them.
            await asyncio.gather(*(self._spawn(worker) for worker in self.workers if worker != "decoder"))
            await self._spawn("decoder")
        else:
            await asyncio.gather(*(self._spawn(worker) for worker in self.workers))
        self.started = True
        if not self.failed:
            self.status = "ready"

    def _decoder_measures_gpu_memory(self) -> bool:
        config = self.config
        if config.num_kv_blocks is not None or config.kv_cache_memory_gib is not None:
            return False
        if config.device == "auto":
            import torch

            return torch.cuda.is_available()
        return config.device.startswith("cuda")

    async def _spawn(self, worker: str) -> None:
        self.to_workers[worker] = self._bind(zmq.PUSH, f"{worker}-in")
        try:
            process = await self._start(worker)
        except BaseException:
            # Closed here, not left to the next start (which binds the address again).
            self.to_workers.pop(worker).close(linger=0)
            raise
        self._last_heard[worker] = time.monotonic()
        self.running.add(worker)
        self._exit_watchers[worker] = asyncio.create_task(self._watch_exit(worker, process), name=f"watch-{worker}")
        logger.info("%s ready (pid %d)", worker, process.pid)
        if worker == "talker":
            self.voice_status = "ready"

    async def _start(self, worker: str):
        """Starts the worker's process and waits until it says it is ready."""
        config = json.dumps(asdict(self.config))
        args = ["-m", f"workers.{worker}_process", "--config", config, *worker_flags(worker, self.addresses)]
        event = self._ready_events[worker] = asyncio.Event()
        process = await self.launcher.start(worker, args)
        self.processes[worker] = process
        exited = asyncio.create_task(process.wait())
        ready = asyncio.create_task(event.wait())
        # Without the reader nobody would see the ready message: do not wait the full timeout.
        done, _ = await asyncio.wait({exited, ready, self.reader}, timeout=WORKER_START_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        ready.cancel()
        if ready not in done:
            if process.returncode is None:
                process.kill()
            raise RuntimeError(f"{worker} process failed to start (exit code {process.returncode})")
        return process

    async def _watch_exit(self, worker: str, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if self.closing:
            return
        reason = self._lost_reasons.pop(worker, None) or f"the {worker} process crashed (exit code {code})"
        self._worker_lost(worker, reason)
        if self.failed:
            return
        budget = self.budgets[worker]
        # A successor that dies while it starts is one more restart, under the same budget:
        # not the end of the server (or of voice) while the budget lasts.
        while True:
            if not budget.try_spend():
                if worker == "talker":  # voice ends; text serving goes on
                    self.voice_status = (f"{reason}; restarted {budget.max_restarts} times within "
                                         f"{budget.window_s:g} s")
                    logger.error("voice is off: %s", self.voice_status)
                    return
                self.fail(f"{reason}; it was restarted {budget.max_restarts} times within {budget.window_s:g} s")
                return
            self.restarts[worker] += 1
            logger.warning("restarting the %s (restart %d)", worker, self.restarts[worker])
            try:
                await self._spawn(worker)
                break
            except Exception as exc:
                reason = f"the {worker} process could not be restarted: {exc}"
                logger.error("%s", reason)
                if worker == "talker":
                    self.voice_status = reason
                if self.closing or self.failed:
                    return
        if not self.failed and self.running == set(self.workers):
            self.status = "ready"

    def _worker_lost(self, worker: str, reason: str) -> None:
        """`on_lost` fails what needed the worker; its socket closes so that messages queued
        for the lost process never reach its successor. Once per process."""
        if worker not in self.running:
            return
        self.running.discard(worker)
        logger.error("%s", reason)
        if worker == "talker":
            # Text goes on; only the answers being spoken end, with the reason.
            self.voice_status = reason
        elif not self.failed:
            self.status = reason
        self.on_lost(worker, reason)
        self.to_workers[worker].close(linger=0)

    def fail(self, reason: str) -> None:
        """The engine cannot go on: unhealthy for good, and the server is told to exit."""
        if self.failed:
            return
        self.failed = True
        logger.error("engine failed: %s", reason)
        self.status = f"failed: {reason}"
        self.on_failed(reason)
        if self.on_fatal is not None:
            self.on_fatal()

    def _background_task_ended(self, task: asyncio.Task) -> None:
        if self.closing:
            return
        cause = "cancelled" if task.cancelled() else repr(task.exception())
        self.fail(f"the frontend's {task.get_name()} task stopped ({cause})")

    async def shutdown(self) -> None:
        self.closing = True
        for socket in self.to_workers.values():
            if not socket.closed:
                try:
                    await socket.send(protocol.encode(protocol.Shutdown()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for process in self.processes.values():
            try:
                await asyncio.wait_for(process.wait(), timeout=5)
            except asyncio.TimeoutError:
                process.kill()  # SIGKILL also ends a stopped process
                await process.wait()
        for task in [*self._background, *self._exit_watchers.values()]:
            task.cancel()
        for socket in [*self.to_workers.values(), self.from_workers, self.from_talker]:
            if socket is not None:
                socket.close(linger=0)
        self.launcher.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def healthy(self) -> bool:
        return self.status == "ready" and not self.failed

    @property
    def serves_text(self) -> bool:
        """Whether a text-only request can run now: every worker came up once, the decoder runs."""
        return self.started and not self.failed and "decoder" in self.running

    # ---- sending ----------------------------------------------------------------------

    async def send(self, worker: str, data: bytes | list, block: bool = True) -> None:
        socket = self.to_workers.get(worker)
        if worker not in self.running or socket is None or socket.closed:
            raise EngineUnavailable(f"engine unavailable: {self.status}")
        try:
            if isinstance(data, list):
                await socket.send_multipart(data, copy=False)
            else:
                await socket.send(data, flags=0 if block else zmq.NOBLOCK)
        except asyncio.CancelledError:
            # Closing the socket (the worker was lost) cancels a pending send; only a
            # cancellation of this task itself goes on as one.
            if asyncio.current_task().cancelling():
                raise
            raise EngineUnavailable(f"engine unavailable: {self.status}") from None
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"engine unavailable: {self.status}") from exc

    def send_in_background(self, worker: str, message) -> None:
        task = asyncio.ensure_future(self._send_quietly(worker, message))
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)

    async def _send_quietly(self, worker: str, data) -> None:
        try:
            await self.send(worker, data)
        except EngineUnavailable:
            pass  # the worker is gone: the requests that needed it fail anyway

    # ---- worker outputs and liveness ---------------------------------------------------

    async def _read_outputs(self) -> None:
        while True:
            try:
                frame = await self.from_workers.recv()
            except zmq.Again:
                continue  # woken with nothing to read (seen on CurveZMQ tcp links): not a failure
            self._last_read = time.monotonic()
            try:
                message = protocol.decode_output(frame)
            except msgspec.DecodeError as exc:
                logger.error("skipped a worker message that does not decode (%d bytes): %s", len(frame), exc)
                continue
            self.route(message)

    def worker_ready(self, message: protocol.WorkerReady) -> None:
        self.heard_from(message.worker)
        event = self._ready_events.get(message.worker)
        if event is not None:
            self.ready[message.worker] = message
            event.set()

    def worker_failed(self, message: protocol.WorkerFailed) -> None:
        self.heard_from(message.worker)
        logger.error("%s reported a failure:\n%s", message.worker, message.message)

    def heard_from(self, worker: str) -> None:
        if worker in self._last_heard:
            self._last_heard[worker] = time.monotonic()

    async def _watch_liveness(self) -> None:
        interval = min(protocol.HEARTBEAT_INTERVAL_S, self.worker_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            # Messages waiting while the reader has not read for a while mean this process
            # fell behind (a busy event loop), not that a worker went quiet. Waiting messages
            # alone say nothing: under load some always are.
            if self.from_workers.get(zmq.EVENTS) & zmq.POLLIN and time.monotonic() - self._last_read >= interval:
                continue
            now = time.monotonic()
            for worker in list(self.running):
                silent_s = now - self._last_heard[worker]
                if silent_s >= self.worker_timeout_s:
                    self._kill_silent(worker, silent_s)

    def _kill_silent(self, worker: str, silent_s: float) -> None:
        reason = f"the {worker} process stopped responding (no message for {silent_s:.0f} s)"
        self._lost_reasons[worker] = reason
        self._worker_lost(worker, reason)
        # SIGKILL ends even a stopped process; its exit watcher then restarts it.
        try:
            self.processes[worker].kill()
        except ProcessLookupError:
            pass
