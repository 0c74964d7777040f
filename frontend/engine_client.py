"""The frontend's side of the actors: spawns the workers, talks to them over ZeroMQ.

Sockets are ipc:// endpoints in a private (0700) temporary directory, so nothing is
reachable from another host. The frontend binds; workers connect. Three background tasks:
one reads every worker output and routes each request's deltas to that request's queue,
one batches aborts to the decoder, one watches that each worker still speaks. Each worker
process also has a task waiting for its exit.

Requests with images register their preprocessed items with the encoder (pixels as frames)
before they go to the decoder, and release them when they end; the decoder asks the encoder
for embeddings itself, on sockets of their own.

With voice on, the encoder also transcribes clips (`transcribe`), and a third worker, the
talker, speaks answers (`open_speech`, `speak`, `cancel_speech`): its audio comes back on a
socket of its own, read by a fourth task. Losing the talker fails the answers being spoken,
not text: /health stays healthy while it restarts (`voice_status` says why voice is down).

A worker is lost when its process exits or when it sends nothing (no heartbeat, no step
output) for `worker_timeout_s`; a silent one is killed. Either way every in-flight request
that needed it ends with an error (all of them for the decoder, those with items for the
encoder), /health turns unhealthy with the reason, and the worker is restarted,
at most `max_restarts` times per worker in any `restart_window_s`; past that, or if a
background task dies, the client fails for good and calls `on_fatal` (the server exits
non-zero).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from engine import protocol
from engine.array_frames import item_frames
from engine.config import EngineConfig
from frontend.restart_budget import RestartBudget
from frontend.tenancy import ANONYMOUS, FairShare, Requester, ShareExhausted, ShareSlot, share_of

logger = logging.getLogger("antiphon.frontend")

WORKER_START_TIMEOUT_S = 600.0
WORKERS = ("encoder", "decoder")
VOICE_WORKERS = ("encoder", "decoder", "talker")
# A clip's transcript may take the encoder's own deadline (how long a clip may wait for the
# recognizer, --encoder-timeout) plus this long to recognize it before the request fails: the
# encoder answers a clip that waited too long itself (429 voice_busy), and the front end's
# deadline must not fire first. A hung encoder is caught by the watchdog sooner; this bounds a
# lost reply.
RECOGNITION_ALLOWANCE_S = 60.0


class EngineUnavailable(RuntimeError):
    """The decoder is not running (starting, restarting or failed)."""


class VoiceBusy(EngineUnavailable):
    """As many clips are being recognized, or answers spoken, as the server allows: try later."""


class EngineClient:
    def __init__(self, config: EngineConfig, *, max_restarts: int = 3, restart_window_s: float = 600.0,
                 worker_timeout_s: float = 30.0, on_fatal=None, max_transcriptions: int = 16,
                 max_spoken_answers: int = 16, share_per_tenant: float = 1.0, share_per_client: float = 1.0) -> None:
        # An idle worker reports every HEARTBEAT_INTERVAL_S; a timeout near that would kill
        # healthy workers for a late beat.
        if worker_timeout_s <= 2 * protocol.HEARTBEAT_INTERVAL_S:
            raise ValueError(f"worker_timeout_s must be more than {2 * protocol.HEARTBEAT_INTERVAL_S:g} s")
        self.config = config
        self.worker_timeout_s = worker_timeout_s
        # One encoder and one talker serve every client: past these, voice work is refused
        # (429) rather than queued behind a flood, and no tenant or client may hold them all.
        self.transcriptions = FairShare("clips being recognized", "--max-transcriptions", max_transcriptions,
                                        share_of(max_transcriptions, share_per_tenant),
                                        share_of(max_transcriptions, share_per_client))
        self.spoken_answers = FairShare("answers being spoken", "--max-spoken-answers", max_spoken_answers,
                                        share_of(max_spoken_answers, share_per_tenant),
                                        share_of(max_spoken_answers, share_per_client))
        self.on_fatal = on_fatal
        self.run_dir = Path(tempfile.mkdtemp(prefix="antiphon-"))
        self.context = zmq.asyncio.Context()
        self.addresses = {name: f"ipc://{self.run_dir}/{name}"
                          for name in ("decoder-in", "encoder-in", "talker-in", "outputs", "speech",
                                       "encoder-asks", "embeddings")}
        self.workers = VOICE_WORKERS if config.voice else WORKERS
        self.from_workers = self.context.socket(zmq.PULL)
        self.from_workers.bind(self.addresses["outputs"])
        self.to_workers: dict[str, zmq.asyncio.Socket] = {}
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        # One queue per registered request: added by add_request, removed when the request
        # finishes, fails or is released.
        self.queues: dict[str, asyncio.Queue] = {}
        self._on_finished: dict[str, object] = {}
        # Requests whose items the encoder holds for them, until they end: their items, whose
        # pixels are sent again if the encoder asks (its cache dropped one sent without).
        self._with_items: dict[str, list] = {}
        # What the encoder's global cache holds, as it last reported: cached items are
        # registered without their pixels.
        self.encoder_cache_mirror: set[str] = set()
        # For /metrics: items registered without pixels (the mirror said cached), pixels resent.
        self.items_sent_cached = 0
        self.items_resent = 0
        self._pending_releases: list[str] = []
        self._resends: set[asyncio.Future] = set()
        self.stats = protocol.EngineStatsSnapshot()
        self.encoder_stats = protocol.EncoderStats()
        self.ready: dict[str, protocol.WorkerReady] = {}
        self.status = "starting"
        self.budgets = {worker: RestartBudget(max_restarts, restart_window_s) for worker in self.workers}
        # For /metrics: restarts since start per worker, and AbortRequests messages sent.
        self.restarts = {worker: 0 for worker in self.workers}
        self.abort_messages_sent = 0
        # Workers that reported ready and have not been lost since.
        self._running: set[str] = set()
        self._last_heard = {worker: 0.0 for worker in self.workers}
        # Voice: clips waiting for their transcript, and answers being spoken (their audio).
        self._transcripts: dict[str, asyncio.Future] = {}
        self.speech_queues: dict[str, asyncio.Queue] = {}
        self._speech_slots: dict[str, ShareSlot] = {}
        self.voice_status = "ready" if config.voice else "voice is off (--no-voice)"
        self.from_talker = None
        if config.voice:
            self.from_talker = self.context.socket(zmq.PULL)
            self.from_talker.bind(self.addresses["speech"])
        self._last_read = 0.0
        # Why a worker the watchdog killed is gone (its exit code alone would say "crashed").
        self._lost_reasons: dict[str, str] = {}
        self._failed = False
        self._started = False
        self._pending_aborts: list[str] = []
        self._aborts_wanted = asyncio.Event()
        self._ready_events: dict[str, asyncio.Event] = {}
        self._reader: asyncio.Task | None = None
        self._background: list[asyncio.Task] = []
        self._exit_watchers: dict[str, asyncio.Task] = {}
        self._closing = False
        self._clip_ids = itertools.count()

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_outputs(), name="worker-outputs")
        self._background = [self._reader,
                            asyncio.create_task(self._send_aborts(), name="abort-sender"),
                            asyncio.create_task(self._watch_liveness(), name="worker-watchdog")]
        if self.from_talker is not None:
            self._background.append(asyncio.create_task(self._read_speech(), name="speech-reader"))
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
        self._started = True
        if not self._failed:
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
        socket = self.context.socket(zmq.PUSH)
        socket.bind(self.addresses[f"{worker}-in"])
        self.to_workers[worker] = socket
        config = json.dumps(asdict(self.config))
        if worker == "decoder":
            args = ["-m", "workers.decoder_process", "--config", config,
                    "--encoder-asks", self.addresses["encoder-asks"], "--embeddings", self.addresses["embeddings"]]
        elif worker == "talker":
            args = ["-m", "workers.talker_process", "--config", config, "--speech", self.addresses["speech"]]
        else:
            args = ["-m", "workers.encoder_process", "--config", config,
                    "--asks", self.addresses["encoder-asks"], "--embeddings", self.addresses["embeddings"]]
        args += ["--input", self.addresses[f"{worker}-in"], "--output", self.addresses["outputs"]]
        event = self._ready_events[worker] = asyncio.Event()
        process = await asyncio.create_subprocess_exec(sys.executable, *args)
        self.processes[worker] = process
        exited = asyncio.create_task(process.wait())
        ready = asyncio.create_task(event.wait())
        # Without the reader nobody would see the ready message: do not wait the full timeout.
        done, _ = await asyncio.wait({exited, ready, self._reader}, timeout=WORKER_START_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        ready.cancel()
        if ready not in done:
            if process.returncode is None:
                process.kill()
            raise RuntimeError(f"{worker} process failed to start (exit code {process.returncode})")
        self._last_heard[worker] = time.monotonic()
        self._running.add(worker)
        self._exit_watchers[worker] = asyncio.create_task(self._watch_exit(worker, process), name=f"watch-{worker}")
        logger.info("%s ready (pid %d)", worker, process.pid)
        if worker == "talker":
            self.voice_status = "ready"

    async def _watch_exit(self, worker: str, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if self._closing:
            return
        reason = self._lost_reasons.pop(worker, None) or f"the {worker} process crashed (exit code {code})"
        self._worker_lost(worker, reason)
        if self._failed:
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
                self._fail(f"{reason}; it was restarted {budget.max_restarts} times within {budget.window_s:g} s")
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
                if self._closing or self._failed:
                    return
        if not self._failed and self._running == set(self.workers):
            self.status = "ready"

    def _worker_lost(self, worker: str, reason: str) -> None:
        """Every in-flight request fails; the worker's socket closes so that messages queued
        for the lost process never reach its successor. Once per process."""
        if worker not in self._running:
            return
        self._running.discard(worker)
        logger.error("%s", reason)
        if worker == "talker":
            # Text goes on; only the answers being spoken end, with the reason.
            self.voice_status = reason
            self._fail_speech(reason)
            self.to_workers[worker].close(linger=0)
            return
        if not self._failed:
            self.status = reason
        if worker == "decoder":
            self._pending_aborts.clear()  # the decoder that ran them is gone
            self._fail_in_flight(reason)
        else:
            # Only requests with items needed the encoder; its successor starts empty.
            self._pending_releases.clear()
            self._fail_in_flight(reason, only=set(self._with_items))
            self._with_items.clear()
            self.encoder_cache_mirror.clear()
            self._fail_transcripts(reason)
            if "decoder" in self._running:
                # Before any request that reaches the encoder's successor: the decoder stops
                # waiting for items asked of the dead one (they would time out one by one).
                self._send_in_background("decoder", protocol.encode(protocol.EncoderLost(reason)))
        self.to_workers[worker].close(linger=0)

    def _fail(self, reason: str) -> None:
        """The client cannot go on: unhealthy for good, and the server is told to exit."""
        if self._failed:
            return
        self._failed = True
        logger.error("engine failed: %s", reason)
        self.status = f"failed: {reason}"
        self._fail_in_flight(reason)
        self._fail_transcripts(reason)
        self._fail_speech(reason)
        if self.on_fatal is not None:
            self.on_fatal()

    def _background_task_ended(self, task: asyncio.Task) -> None:
        if self._closing:
            return
        cause = "cancelled" if task.cancelled() else repr(task.exception())
        self._fail(f"the frontend's {task.get_name()} task stopped ({cause})")

    async def shutdown(self) -> None:
        self._closing = True
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
        self.context.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def healthy(self) -> bool:
        return self.status == "ready" and not self._failed

    @property
    def serves_text(self) -> bool:
        """Whether a text-only request can run now: every worker came up once, the decoder runs."""
        return self._started and not self._failed and "decoder" in self._running

    @property
    def num_registered(self) -> int:
        """Requests with a queue: sent to the decoder and neither finished nor released."""
        return len(self.queues)

    # ---- requests ---------------------------------------------------------------------

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
        if not self.serves_text or (items and "encoder" not in self._running):
            raise EngineUnavailable(f"engine unavailable: {self.status}")
        if request.request_id in self.queues:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request.request_id] = queue
        if on_finished is not None:
            self._on_finished[request.request_id] = on_finished
        try:
            if items:
                self._with_items[request.request_id] = list(items)
                headers, frames = item_frames(list(items), self.encoder_cache_mirror)
                self.items_sent_cached += len(headers) - len(frames)
                register = protocol.encode(protocol.RegisterItems(request.request_id, headers))
                await self._send("encoder", [register, *frames])
            await self._send("decoder", data)
        except BaseException:
            self.release(request.request_id)
            raise
        return queue

    def release(self, request_id: str) -> None:
        """Forget a request the caller no longer reads: if it is still registered (not finished),
        unregister it and have the decoder abort it. Synchronous and idempotent, so a
        done-callback can call it; the abort leaves shortly after, batched with others."""
        self._on_finished.pop(request_id, None)
        self._release_items(request_id)
        if self.queues.pop(request_id, None) is None:
            return
        if "decoder" in self._running:
            self._pending_aborts.append(request_id)
            self._aborts_wanted.set()

    def _release_items(self, request_id: str) -> None:
        if request_id in self._with_items:
            del self._with_items[request_id]
            if "encoder" in self._running:
                self._pending_releases.append(request_id)
                self._aborts_wanted.set()

    def _fail_in_flight(self, message: str, only: set[str] | None = None) -> None:
        for request_id, queue in list(self.queues.items()):
            if only is not None and request_id not in only:
                continue
            queue.put_nowait(protocol.RequestDelta(request_id, [], "error", error=message))
            callback = self._on_finished.pop(request_id, None)
            # A decoder still running (another worker was lost) must stop these too.
            self.release(request_id)
            if callback is not None:
                callback()

    def _finished(self, request_id: str) -> None:
        self._release_items(request_id)
        callback = self._on_finished.pop(request_id, None)
        if callback is not None:
            callback()

    async def _send(self, worker: str, data: bytes | list, block: bool = True) -> None:
        socket = self.to_workers.get(worker)
        if worker not in self._running or socket is None or socket.closed:
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

    async def _send_aborts(self) -> None:
        while True:
            await self._aborts_wanted.wait()
            self._aborts_wanted.clear()
            released, self._pending_releases = self._pending_releases, []
            if released:
                try:
                    await self._send("encoder", protocol.encode(protocol.ReleaseItems(released)))
                except EngineUnavailable:
                    pass  # the encoder is gone, and with it every item it held
            request_ids, self._pending_aborts = self._pending_aborts, []
            if not request_ids:
                continue
            try:
                await self._send("decoder", protocol.encode(protocol.AbortRequests(request_ids)))
            except EngineUnavailable:
                continue  # the decoder is gone, and with it every request it ran
            self.abort_messages_sent += 1

    # ---- voice ------------------------------------------------------------------------

    @property
    def voice_ready(self) -> bool:
        return self.config.voice and "talker" in self._running and not self._failed

    async def transcribe(self, samples, requester: Requester = ANONYMOUS) -> protocol.AudioTranscript:
        """The encoder's transcript of a clip (float32 mono samples at 16 kHz); raises
        EngineUnavailable when voice is off or the encoder is gone or never answers, VoiceBusy
        when the server, or this requester's share of it, recognizes as many clips as it may."""
        import numpy as np

        if not self.config.voice:
            raise EngineUnavailable("voice is off on this server (--no-voice)")
        slot = _voice_slot(self.transcriptions, requester)
        request_id = f"clip-{next(self._clip_ids)}"
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._transcripts[request_id] = future
        # The share counts the encoder's work, not this caller's wait: a caller that gives up
        # (a client gone, speech that resumed) leaves its clip being recognized, so the slot
        # stays taken until the encoder answers, fails or the timeout passes.
        expiry = loop.call_later(self.transcribe_timeout_s, self._expire_clip, request_id)
        def clip_done(done: asyncio.Future) -> None:
            slot.release()
            expiry.cancel()
            self._transcripts.pop(request_id, None)
            if not done.cancelled():
                done.exception()  # read here: a caller that gave up never will

        future.add_done_callback(clip_done)
        try:
            header = protocol.encode(protocol.TranscribeAudio(request_id, owner=f"{requester.tenant}/{requester.client}"))
            await self._send("encoder", [header, np.ascontiguousarray(samples, dtype=np.float32).data])
        except BaseException:
            future.cancel()  # the clip never reached the encoder
            raise
        return await asyncio.shield(future)

    def _expire_clip(self, request_id: str) -> None:
        future = self._transcripts.pop(request_id, None)
        if future is not None and not future.done():
            future.set_exception(EngineUnavailable(f"no transcript within {self.transcribe_timeout_s:g} s"))

    @property
    def transcribe_timeout_s(self) -> float:
        return self.config.encoder_timeout_s + RECOGNITION_ALLOWANCE_S

    def open_speech(self, request_id: str, requester: Requester = ANONYMOUS) -> asyncio.Queue:
        """A queue that receives the answer's SpeechAudio messages as (header, pcm bytes),
        the last with `final` set. Call `speak` to feed it text; `cancel_speech` to stop."""
        if not self.voice_ready:
            raise EngineUnavailable(f"voice unavailable: {self.voice_status}")
        if request_id in self.speech_queues:
            raise ValueError(f"speech {request_id!r} is already in flight")
        self._speech_slots[request_id] = _voice_slot(self.spoken_answers, requester)
        queue: asyncio.Queue = asyncio.Queue()
        self.speech_queues[request_id] = queue
        return queue

    def _end_speech(self, request_id: str) -> asyncio.Queue | None:
        """Forget an answer's audio queue and free its share of the talker; None if it had ended."""
        slot = self._speech_slots.pop(request_id, None)
        if slot is not None:
            slot.release()
        return self.speech_queues.pop(request_id, None)

    async def speak(self, request_id: str, text: str, *, sample_rate: int, final: bool = False,
                    speed: float = 1.0) -> None:
        if request_id not in self.speech_queues:
            return  # cancelled or failed meanwhile: nothing listens any more
        # Never blocks: a talker that stopped reading must not hold up the answer's text.
        await self._send("talker", protocol.encode(protocol.SpeakText(
            request_id=request_id, text=text, final=final, sample_rate=sample_rate, speed=speed)), block=False)

    def cancel_speech(self, request_id: str) -> None:
        """Stop speaking an answer (barge-in, a client gone); idempotent and synchronous."""
        if self._end_speech(request_id) is None or "talker" not in self._running:
            return
        self._send_in_background("talker", protocol.encode(protocol.CancelSpeech([request_id])))

    def _send_in_background(self, worker: str, message: bytes) -> None:
        task = asyncio.ensure_future(self._send_quietly(worker, message))
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)

    async def _read_speech(self) -> None:
        while True:
            frames = await self.from_talker.recv_multipart(copy=False)
            try:
                message = protocol.decode_speech(frames[0].bytes)
            except msgspec.DecodeError as exc:
                logger.error("skipped a talker message that does not decode: %s", exc)
                continue
            self._heard_from("talker")
            queue = self.speech_queues.get(message.request_id)
            if queue is None:
                continue  # cancelled: the talker has been told
            queue.put_nowait((message, frames[1].bytes if len(frames) > 1 else b""))
            if message.final:
                self._end_speech(message.request_id)

    def _fail_speech(self, reason: str) -> None:
        for request_id in list(self.speech_queues):
            self._end_speech(request_id).put_nowait((protocol.SpeechAudio(
                request_id=request_id, sample_rate=0, final=True, error=reason), b""))

    def _fail_transcripts(self, reason: str) -> None:
        for future in self._transcripts.values():
            if not future.done():
                future.set_exception(EngineUnavailable(f"engine unavailable: {reason}"))
        self._transcripts.clear()

    # ---- worker outputs and liveness ---------------------------------------------------

    async def _read_outputs(self) -> None:
        while True:
            frame = await self.from_workers.recv()
            self._last_read = time.monotonic()
            try:
                message = protocol.decode_output(frame)
            except msgspec.DecodeError as exc:
                logger.error("skipped a worker message that does not decode (%d bytes): %s", len(frame), exc)
                continue
            self._route(message)

    def _route(self, message: protocol.WorkerOutput) -> None:
        if isinstance(message, protocol.StepOutputs):
            self._heard_from("decoder")
            self.stats = message.stats
            for delta in message.deltas:
                queue = self.queues.get(delta.request_id)
                if queue is None:
                    continue  # released by the frontend; the decoder has been told
                queue.put_nowait(delta)
                if delta.finish_reason is not None:
                    del self.queues[delta.request_id]
                    self._finished(delta.request_id)
        elif isinstance(message, protocol.Heartbeat):
            self._heard_from(message.worker)
        elif isinstance(message, protocol.EncoderStats):
            self.encoder_stats = message
        elif isinstance(message, protocol.CacheChanges):
            self.encoder_cache_mirror.difference_update(message.evicted)
            self.encoder_cache_mirror.update(message.added)
        elif isinstance(message, protocol.ItemsMissing):
            self._resend_pixels(set(message.mm_hashes))
        elif isinstance(message, protocol.WorkerReady):
            self._heard_from(message.worker)
            event = self._ready_events.get(message.worker)
            if event is not None:
                self.ready[message.worker] = message
                event.set()
        elif isinstance(message, protocol.AudioTranscript):
            self._heard_from("encoder")
            future = self._transcripts.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, protocol.WorkerFailed):
            self._heard_from(message.worker)
            logger.error("%s reported a failure:\n%s", message.worker, message.message)

    def _resend_pixels(self, wanted: set[str]) -> None:
        """Register again, with pixels, the items the encoder could not find (a race between
        its eviction and our mirror): any live request that holds them will do."""
        for request_id, items in self._with_items.items():
            found = [item for item in items if item.mm_hash in wanted]
            if found:
                wanted -= {item.mm_hash for item in found}
                self.items_resent += len(found)
                headers, frames = item_frames(found)
                message = [protocol.encode(protocol.RegisterItems(request_id, headers)), *frames]
                self._send_in_background("encoder", message)
            if not wanted:
                return

    async def _send_quietly(self, worker: str, data) -> None:
        try:
            await self._send(worker, data)
        except EngineUnavailable:
            pass  # the encoder is gone: the requests that needed it fail anyway

    def _heard_from(self, worker: str) -> None:
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
            for worker in list(self._running):
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


def _voice_slot(share: FairShare, requester: Requester) -> ShareSlot:
    try:
        return share.take(requester)
    except ShareExhausted as exc:
        raise VoiceBusy(str(exc)) from None
