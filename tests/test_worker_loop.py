"""The worker main loop (workers/worker_loop.py) over real ZeroMQ sockets, with a worker made
of plain callables standing in for the encoder or the talker."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import zmq

from engine import protocol
from workers.worker_loop import WorkerLoop


class RecordingWorker:
    """Records what the loop hands it; `turns` holds, per work call, what had arrived since."""

    def __init__(self, tmp_path, busy: bool = False) -> None:
        self.arrived: list = []
        self.turns: list[list] = []
        self.work_calls = 0
        self.beats_seen = 0
        self.busy = busy
        self.loop = WorkerLoop("encoder", f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/output",
                               protocol.decode_encoder_input, handle=self._handle, work=self._work,
                               busy=lambda: self.busy, on_beat=self._on_beat)
        self.side = self.loop.bind_pull(f"ipc://{tmp_path}/side", lambda frames: self.arrived.append(frames[0].bytes))

    def _handle(self, message, frames) -> None:
        self.arrived.append((message, [frame.bytes for frame in frames]))

    def _work(self) -> None:
        self.work_calls += 1
        if self.arrived:
            self.turns.append(self.arrived)
            self.arrived = []

    def _on_beat(self) -> None:
        self.beats_seen += 1


@pytest.fixture
def frontend(tmp_path):
    context = zmq.Context()
    inputs, outputs, side = context.socket(zmq.PUSH), context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.bind(f"ipc://{tmp_path}/input")
    outputs.bind(f"ipc://{tmp_path}/output")
    yield context, inputs, outputs, side
    for socket in (inputs, outputs, side):
        socket.close(linger=0)
    context.term()


@contextlib.contextmanager
def running(worker: RecordingWorker, inputs):
    """The worker's loop on a thread; a Shutdown must end it."""
    thread = threading.Thread(target=worker.loop.run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        inputs.send(protocol.encode(protocol.Shutdown()))
        thread.join(timeout=10)
        worker.loop.close()
    assert not thread.is_alive(), "a Shutdown did not end the loop"


def first_turn(worker: RecordingWorker) -> list:
    deadline = time.monotonic() + 5
    while not worker.turns and time.monotonic() < deadline:
        time.sleep(0.01)
    return worker.turns[0] if worker.turns else []


def test_what_arrived_together_is_handled_before_one_work_call(tmp_path, frontend):
    _, inputs, _, side = frontend
    worker = RecordingWorker(tmp_path)
    side.connect(f"ipc://{tmp_path}/side")
    release = protocol.ReleaseItems(["r1"])
    # Queued before the loop runs: one turn must take all of it.
    inputs.send_multipart([protocol.encode(release), b"pixels"])
    side.send(b"ask")
    inputs.send(protocol.encode(protocol.ReleaseItems(["r2"])))
    time.sleep(0.2)
    with running(worker, inputs):
        assert first_turn(worker) == [(release, [b"pixels"]), b"ask", (protocol.ReleaseItems(["r2"]), [])]


def test_an_undecodable_input_is_skipped_and_the_loop_goes_on(tmp_path, frontend, caplog):
    _, inputs, _, _ = frontend
    worker = RecordingWorker(tmp_path)
    with running(worker, inputs):
        inputs.send(b"\xc1 not msgpack")
        inputs.send(protocol.encode(protocol.ReleaseItems(["r1"])))
        assert first_turn(worker) == [(protocol.ReleaseItems(["r1"]), [])]
        assert "skipped an undecodable input" in caplog.text


def test_the_loop_beats_on_a_clock_while_inputs_keep_arriving(tmp_path, frontend):
    _, inputs, outputs, _ = frontend
    worker = RecordingWorker(tmp_path)
    with running(worker, inputs):
        beats = []
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            # An input more often than the heartbeat interval.
            inputs.send(protocol.encode(protocol.ReleaseItems([])))
            while outputs.poll(200):
                message = protocol.decode_output(outputs.recv())
                if isinstance(message, protocol.Heartbeat):
                    assert message.worker == "encoder"
                    beats.append(time.monotonic())
        assert len(beats) >= 3
        assert max(b - a for a, b in zip(beats, beats[1:])) < protocol.HEARTBEAT_INTERVAL_S + 0.5
        assert worker.beats_seen >= len(beats)  # on_beat goes with every heartbeat


def test_a_busy_worker_works_without_waiting_for_input_or_beat(tmp_path, frontend):
    _, inputs, _, _ = frontend
    worker = RecordingWorker(tmp_path, busy=True)
    with running(worker, inputs):
        time.sleep(0.3)
        # Idle, the loop would sleep up to a heartbeat interval between turns.
        assert worker.work_calls > 10


def test_ready_names_the_worker(tmp_path, frontend):
    _, _, outputs, _ = frontend
    worker = RecordingWorker(tmp_path)
    try:
        worker.loop.ready()
        assert outputs.poll(5000)
        message = protocol.decode_output(outputs.recv())
        assert isinstance(message, protocol.WorkerReady) and message.worker == "encoder"
    finally:
        worker.loop.close()
