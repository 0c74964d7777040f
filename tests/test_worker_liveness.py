"""The real server when a worker hangs, crashes or a stray frame reaches the frontend."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from engine import protocol
from tests.server_harness import REPO, ServerProcess, get_json, request, wait_for

HELLO = [{"role": "user", "content": "hello"}]
WORKER_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    process = ServerProcess(tiny_llama, "--worker-timeout", str(WORKER_TIMEOUT_S),
                            log_dir=tmp_path_factory.mktemp("logs"))
    yield process
    assert process.stop() == 0, process.log_text()


def outputs_address(server) -> str:
    """The frontend's outputs socket, as the decoder was told on its command line."""
    (decoder,) = server.worker_pids("decoder")
    with open(f"/proc/{decoder}/cmdline", "rb") as cmdline:
        args = cmdline.read().decode().split("\0")
    return args[args.index("--output") + 1]


def complete(server, max_tokens: int = 4, timeout: float = 30.0) -> tuple[int, dict]:
    status, text = request("POST", server.url + "/v1/chat/completions",
                           # ignore_eos: a sampled answer may end early at EOS; these tests count the tokens.
                           {"messages": HELLO, "max_tokens": max_tokens, "ignore_eos": True},
                           {"Content-Type": "application/json"},
                           timeout=timeout)
    return status, json.loads(text)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def replaced(server, worker: str, old_pid: int) -> bool:
    pids = server.worker_pids(worker)
    return bool(pids) and old_pid not in pids and get_json(server.url + "/health")[0] == 200


def test_undecodable_frames_on_the_outputs_socket_are_skipped(server):
    context = zmq.Context()
    stray = context.socket(zmq.PUSH)
    stray.connect(outputs_address(server))
    try:
        for frame in (b"\xc1", b"not msgpack at all", msgspec.msgpack.encode({"type": "no-such-message"}),
                      msgspec.msgpack.encode({"type": "heartbeat", "worker": 7})):
            stray.send(frame)
        status, body = complete(server)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4
        assert get_json(server.url + "/health") == (200, {"status": "ok", "voice": "voice is off (--no-voice)"})
    finally:
        stray.close(linger=0)
        context.term()


def test_stopped_decoder_fails_in_flight_requests_and_is_killed_and_replaced(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WORKER_TIMEOUT_S + 30)
    connection.request("POST", "/v1/chat/completions", json.dumps({
        "messages": HELLO, "max_tokens": 400, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the first event: the request is in the decoder
    (decoder,) = server.worker_pids("decoder")
    os.kill(decoder, signal.SIGSTOP)
    try:
        rest = response.read().decode()  # ends when the watchdog fails the request
        assert "the decoder process stopped responding" in rest
        status, health = get_json(server.url + "/health")
        assert status == 503 and "decoder process stopped responding" in health["reason"]
        assert wait_for(lambda: not alive(decoder), 10), "the hung decoder was not killed"
        assert wait_for(lambda: replaced(server, "decoder", decoder), 120), server.log_text()
        status, body = complete(server)
        assert status == 200, body
    finally:
        connection.close()
        if alive(decoder):
            os.kill(decoder, signal.SIGCONT)


def test_encoder_crash_does_not_spend_the_decoders_restart_budget(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama, "--max-worker-restarts", "1", log_dir=tmp_path)
    try:
        (encoder,) = server.worker_pids("encoder")
        os.kill(encoder, signal.SIGKILL)
        assert wait_for(lambda: replaced(server, "encoder", encoder), 60), server.log_text()
        # The decoder still has its one restart.
        (decoder,) = server.worker_pids("decoder")
        os.kill(decoder, signal.SIGKILL)
        assert wait_for(lambda: replaced(server, "decoder", decoder), 120), server.log_text()
        status, body = complete(server)
        assert status == 200, body
        # Its second crash inside the window is one too many: the server exits non-zero.
        (decoder,) = server.worker_pids("decoder")
        os.kill(decoder, signal.SIGKILL)
        assert server.process.wait(timeout=60) == 1, server.log_text()
        assert "decoder process crashed" in server.log_text()
    finally:
        server.stop()


def test_a_successor_that_dies_while_it_starts_is_restarted_again(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama, "--max-worker-restarts", "5", log_dir=tmp_path)
    try:
        (encoder,) = server.worker_pids("encoder")
        os.kill(encoder, signal.SIGKILL)
        assert wait_for(lambda: [p for p in server.worker_pids("encoder") if p != encoder], 30), server.log_text()
        (successor,) = [p for p in server.worker_pids("encoder") if p != encoder]
        os.kill(successor, signal.SIGKILL)  # seconds before it could say it is ready
        assert wait_for(lambda: replaced(server, "encoder", successor) and encoder not in server.worker_pids("encoder")
                        and get_json(server.url + "/health")[0] == 200, 120), server.log_text()
        assert server.process.poll() is None
        assert "encoder process could not be restarted" in server.log_text()
        status, body = complete(server)
        assert status == 200, body
    finally:
        server.stop()


def test_encoder_beats_while_inputs_keep_arriving(tmp_path, tiny_llama):
    context = zmq.Context()
    to_encoder, from_encoder = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    to_encoder.bind(f"ipc://{tmp_path}/in")
    from_encoder.bind(f"ipc://{tmp_path}/out")
    encoder = subprocess.Popen([sys.executable, "-m", "workers.encoder_process", "--input", f"ipc://{tmp_path}/in",
                                "--output", f"ipc://{tmp_path}/out", "--asks", f"ipc://{tmp_path}/asks",
                                "--embeddings", f"ipc://{tmp_path}/embeddings",
                                "--config", json.dumps({"model": str(tiny_llama)})], cwd=REPO)
    try:
        assert from_encoder.poll(60_000), "the encoder never reported ready"
        assert isinstance(protocol.decode_output(from_encoder.recv()), protocol.WorkerReady)
        beats = 0
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            # An input more often than the heartbeat interval.
            to_encoder.send(protocol.encode(protocol.ReleaseItems([])))
            while from_encoder.poll(200):
                beats += isinstance(protocol.decode_output(from_encoder.recv()), protocol.Heartbeat)
        assert beats >= 2
        to_encoder.send(protocol.encode(protocol.Shutdown()))
        assert encoder.wait(timeout=10) == 0
    finally:
        if encoder.poll() is None:
            encoder.kill()
            encoder.wait()
        to_encoder.close(linger=0)
        from_encoder.close(linger=0)
        context.term()
