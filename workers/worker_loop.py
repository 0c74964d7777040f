"""The main loop of a worker process that serves the frontend's messages (the encoder, the
talker), and every worker's `main` (worker_main: its flags, from engine/worker_sockets.py).

The loop owns the worker's ZeroMQ context and sockets: the input socket from the frontend, the
output socket back to it (ready, heartbeats, what the worker reports) and whatever other
sockets the worker asks for. Each turn it sleeps until a message arrives or the next heartbeat
is due (not at all while the worker says it is busy), takes every message that has arrived,
lets the worker work, and beats if a beat is due. A Shutdown on the input socket ends the loop;
an input that does not decode is logged and skipped. The worker keeps only what is its own:
what it loads, how it handles a message, what it does with a turn.

The decoder runs a loop of its own (workers/decoder_process.py), though it starts through
worker_main: its wake-ups follow its steps, any output it sends counts as a beat, and an input
it cannot decode fails it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import msgspec
import zmq

from engine import link_keys, protocol
from engine.config import EngineConfig
from engine.worker_sockets import WORKER_SOCKETS
from workers.process_guard import run_worker, start_worker_process

# How long closing may wait to deliver what the output socket still holds (a failure report).
OUTPUT_LINGER_MS = 1000

Receive = Callable[[list[zmq.Frame]], None]


class WorkerLoop:
    def __init__(self, name: str, input_address: str, output_address: str, decode: Callable[[bytes], object],
                 handle: Callable[[object, list[zmq.Frame]], None], work: Callable[[], None],
                 busy: Callable[[], bool] = lambda: False, on_beat: Callable[[], None] = lambda: None) -> None:
        """`decode` turns an input's first frame into a message; `handle(message, frames)` takes
        each one but Shutdown, with the frames that follow its header; `work` runs once a turn,
        after the inputs; while `busy` says so the loop does not sleep; `on_beat` sends what
        goes with each heartbeat."""
        self.name = name
        self.logger = logging.getLogger(f"antiphon.{name}")
        self.context = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._receivers: dict[zmq.Socket, Receive] = {}
        self._poller = zmq.Poller()
        self.inputs = self._socket(zmq.PULL)  # from the frontend
        link_keys.connect(self.inputs, input_address)
        self._poller.register(self.inputs, zmq.POLLIN)
        self.outputs = self.connect_push(output_address)  # to the frontend
        self._decode = decode
        self._handle = handle
        self._work = work
        self._busy = busy
        self._on_beat = on_beat
        self._last_beat = 0.0

    def connect_push(self, address: str) -> zmq.Socket:
        """A socket the worker sends on, connected to `address`."""
        socket = self._socket(zmq.PUSH)
        link_keys.connect(socket, address)
        return socket

    def bind_pull(self, address: str, receive: Receive, unbounded: bool = False) -> zmq.Socket:
        """A socket bound at `address` for peers to connect to; the loop takes its messages
        with the inputs and hands each one's frames to `receive`. `unbounded`: it queues
        whatever its peers send (their senders rely on it never refusing)."""
        socket = self._socket(zmq.PULL)
        if unbounded:
            socket.setsockopt(zmq.RCVHWM, 0)
        socket.bind(address)
        self._poller.register(socket, zmq.POLLIN)
        self._receivers[socket] = receive
        return socket

    def _socket(self, kind: int) -> zmq.Socket:
        socket = self.context.socket(kind)
        self._sockets.append(socket)
        return socket

    def send(self, message) -> None:
        """Sends `message` to the frontend on the output socket."""
        self.outputs.send(protocol.encode(message))

    def ready(self, **details) -> None:
        """Tells the frontend the worker has loaded (WorkerReady `details`): the last thing its
        `load` does."""
        self.send(protocol.WorkerReady(worker=self.name, pid=os.getpid(), **details))

    def run(self) -> None:
        while True:
            wait_ms = 0 if self._busy() else max(0, int((self._last_beat + protocol.HEARTBEAT_INTERVAL_S
                                                         - time.monotonic()) * 1000))
            ready = dict(self._poller.poll(wait_ms))
            # Take everything that has arrived, then let the worker work on it at once.
            while ready:
                if self.inputs in ready and not self._take_input(self.inputs.recv_multipart(copy=False)):
                    return
                for socket, receive in self._receivers.items():
                    if socket in ready:
                        receive(socket.recv_multipart(copy=False))
                # Inputs that keep arriving must not keep the frontend from hearing this loop.
                self.beat_if_due()
                ready = dict(self._poller.poll(0))
            self._work()
            # Beat on a clock, not only when idle: a steady stream of inputs must not keep
            # the frontend from hearing that this loop is alive.
            self.beat_if_due()

    def _take_input(self, frames: list[zmq.Frame]) -> bool:
        """Hands one input to the worker; False for a Shutdown."""
        try:
            message = self._decode(frames[0].bytes)
        except msgspec.DecodeError as exc:
            self.logger.error("skipped an undecodable input (%d bytes): %s", len(frames[0].bytes), exc)
            return True
        if isinstance(message, protocol.Shutdown):
            return False
        self._handle(message, frames[1:])
        return True

    def beat(self) -> None:
        """Sends a heartbeat now. Only the loop's thread beats, so that a hung loop goes quiet."""
        self.send(protocol.Heartbeat(worker=self.name, pid=os.getpid()))
        self._on_beat()
        self._last_beat = time.monotonic()

    def beating_while(self, executor, limit_s: float, work, *args, **kwargs):
        """`work` on `executor`'s thread while this loop's thread keeps beating: a long piece of
        work on a busy CPU is work, not a hang, and the frontend's watchdog must not kill it.
        Past `limit_s` the beats stop, so work that truly hangs is still caught."""
        future = executor.submit(work, *args, **kwargs)
        started = time.monotonic()
        while True:
            try:
                return future.result(timeout=protocol.HEARTBEAT_INTERVAL_S)
            except FutureTimeout:
                if time.monotonic() - started < limit_s:
                    self.beat()

    def beat_if_due(self) -> None:
        if time.monotonic() - self._last_beat >= protocol.HEARTBEAT_INTERVAL_S:
            self.beat()

    def close(self) -> None:
        for socket in self._sockets:
            # The output lingers a moment: it may carry the worker's last words (WorkerFailed).
            socket.close(linger=OUTPUT_LINGER_MS if socket is self.outputs else 0)
        self.context.term()


def worker_main(name: str, make_worker: Callable[[EngineConfig, argparse.Namespace], object]) -> None:
    """The `main` of `python -m workers.<name>_process --config JSON --<socket> ADDR ...` (its
    sockets: engine/worker_sockets.py): reads the arguments, ties the process to the frontend
    and runs the worker (workers/process_guard.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    for flag in WORKER_SOCKETS[name]:
        parser.add_argument(f"--{flag}", required=True)
    args = parser.parse_args()
    start_worker_process(name)
    worker = make_worker(EngineConfig(**json.loads(args.config)), args)
    run_worker(name, worker)
