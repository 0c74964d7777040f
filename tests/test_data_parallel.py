"""The real server with two data-parallel replicas placed by a real Ray cluster on this machine
(started here: `ray start --head`, real actors, not Ray's local mode): answers over HTTP and
Realtime equal the single engine's greedy tokens, a conversation's turns go to the replica that
holds its prefix, voice works through the replicas, a peer without the front end's keys reaches
nothing, and a killed replica's requests end at once while the replica comes back."""

import base64
import http.client
import json
import os
import re
import signal
import subprocess
import sys

import openai
import psutil
import pytest
import zmq

from engine import LLM, protocol
from engine.audio_formats import read_wav, write_wav
from frontend.client import RealtimeClient
from tests.server_harness import ServerProcess, free_port, get_json, post_json, request, wait_for
from tests.spoken import spoken, words
from tests.test_server import greedy_offline

SYSTEM = {"role": "system", "content": "You answer questions about the weather in the mountains. " * 4}


def ray_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def ray_cluster():
    port = free_port()
    started = ray_cli("start", "--head", f"--port={port}", "--num-cpus=2", "--node-ip-address=127.0.0.1",
                      "--include-dashboard=false", "--disable-usage-stats")
    assert started.returncode == 0, started.stdout + started.stderr
    yield f"127.0.0.1:{port}"
    ray_cli("stop", "--force")


@pytest.fixture(scope="module")
def server(tiny_llama, ray_cluster, tmp_path_factory):
    # Voice on: each replica's encoder hears clips (Whisper) and its talker speaks (Piper), over
    # the same authenticated links.
    process = ServerProcess(tiny_llama, "--data-parallel-size", "2", "--ray-address", ray_cluster,
                            log_dir=tmp_path_factory.mktemp("logs"), timeout=600, voice=True)
    yield process
    assert process.stop() == 0, process.log_text()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=256)


def replica_series(server, name: str) -> list[float]:
    status, text = request("GET", server.url + "/metrics")
    values = {}
    for line in text.splitlines():
        found = re.match(rf'{name}\{{replica="(\d+)"\}} (\S+)', line)
        if found:
            values[int(found[1])] = float(found[2])
    return [values[index] for index in sorted(values)]


def chat(server, messages, max_tokens=16) -> dict:
    status, body = post_json(server.url + "/v1/chat/completions", {
        "messages": messages, "temperature": 0, "max_tokens": max_tokens, "return_token_ids": True})
    assert status == 200, body
    return body


def test_answers_on_both_replicas_equal_the_single_engines(server, offline):
    for n in range(10):
        conversation = [{"role": "user", "content": f"hello {n}"}]
        expected = greedy_offline(offline, conversation, 16)
        choice = chat(server, conversation)["choices"][0]
        assert choice["token_ids"] == expected.token_ids
        assert choice["message"]["content"] == expected.text
    routed = replica_series(server, "antiphon_replica_requests_routed_total")
    assert len(routed) == 2 and all(count > 0 for count in routed), routed
    status, health = get_json(server.url + "/health")
    assert status == 200 and [replica["status"] for replica in health["replicas"]] == ["ready", "ready"]


async def test_realtime_answers_through_the_replicas(server, offline):
    first = greedy_offline(offline, [SYSTEM, {"role": "user", "content": "hello"}], 12)
    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0, max_output_tokens=12, instructions=SYSTEM["content"])
        before = replica_series(server, "antiphon_replica_requests_routed_total")
        response = await client.create_response([{"role": "user", "content": "hello"}])
        await response.wait()
        assert response.text == first.text
        follow_up = await client.create_response([{"role": "user", "content": "and tomorrow?"}])
        await follow_up.wait()
        expected = greedy_offline(offline, [SYSTEM, {"role": "user", "content": "hello"},
                                            {"role": "assistant", "content": first.text},
                                            {"role": "user", "content": "and tomorrow?"}], 12)
        assert follow_up.text == expected.text
    after = replica_series(server, "antiphon_replica_requests_routed_total")
    # Both turns of the session went to one replica.
    assert sorted(a - b for a, b in zip(after, before)) == [0, 2]


def test_a_conversations_turns_go_to_the_replica_holding_its_prefix(server):
    for topic in ("rivers", "glaciers", "passes"):
        system = {"role": "system", "content": f"You only talk about {topic}, at length and in detail. " * 4}
        messages = [system, {"role": "user", "content": "first question"}]
        routed = replica_series(server, "antiphon_replica_requests_routed_total")
        answer = chat(server, messages, 8)
        holder = [a - b for a, b in zip(replica_series(server, "antiphon_replica_requests_routed_total"),
                                        routed)].index(1)
        for turn in range(2):
            messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"question {turn}"}]
            before = replica_series(server, "antiphon_replica_requests_routed_for_prefix_total")
            answer = chat(server, messages, 8)
            after = replica_series(server, "antiphon_replica_requests_routed_for_prefix_total")
            assert after[holder] == before[holder] + 1, (topic, turn, before, after)
            # The replica it went to did hold the prefix: the system prompt's blocks at least.
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_voice_through_the_replicas(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for _ in range(2):  # the clips go to both replicas' encoders in turn
        clip = write_wav(spoken("What is the capital of France?", rate=16000), 16000)
        transcript = client.audio.transcriptions.create(model="whisper-1", file=("q.wav", clip))
        assert words(transcript.text) == words("What is the capital of France?")
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input="Hello there.",
                                                            response_format="wav") as response:
        samples, rate = read_wav(response.read())
    assert len(samples) > rate // 4


def front_end_tcp_ports(server) -> list[int]:
    listening = psutil.Process(server.process.pid).net_connections(kind="tcp")
    return [c.laddr.port for c in listening if c.status == psutil.CONN_LISTEN and c.laddr.port != server.port]


def test_a_peer_without_the_keys_reaches_nothing(server):
    ports = front_end_tcp_ports(server)
    # Each replica's outputs and decoder/encoder inputs: the front end's links to its workers.
    assert len(ports) >= 6, ports
    context = zmq.Context()
    forged_load = protocol.StepOutputs([protocol.RequestDelta("anything", [1], "stop")],
                                       protocol.EngineStatsSnapshot(num_waiting=999))
    sockets = []
    try:
        for port in ports:
            push = context.socket(zmq.PUSH)
            pull = context.socket(zmq.PULL)
            for socket in (push, pull):
                socket.connect(f"tcp://127.0.0.1:{port}")
                sockets.append(socket)
            for message in (forged_load, protocol.WorkerReady(worker="decoder", pid=1)):
                try:
                    push.send(protocol.encode(message), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        # Nothing the front end sends to its workers reaches the stranger, even while it serves.
        chat(server, [{"role": "user", "content": "hello 1"}], 4)
        assert not any(socket.poll(500) for socket in sockets if socket.type == zmq.PULL)
        assert replica_series(server, "antiphon_replica_requests_waiting") == [0, 0]
        assert get_json(server.url + "/health")[0] == 200
    finally:
        for socket in sockets:
            socket.close(linger=0)
        context.term()


def decoder_pid(server, replica: int) -> int:
    started = re.findall(rf"replica {replica}: decoder actor started \(pid (\d+)", server.log_text())
    return int(started[-1])


def test_a_killed_replica_fails_its_requests_and_comes_back(server):
    connections = []
    for n in range(2):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        connection.request("POST", "/v1/chat/completions", json.dumps({
            "messages": [SYSTEM, {"role": "user", "content": "tell me everything"}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")
        connections.append((connection, response))
    in_flight = [replica["requests_in_flight"] for replica in get_json(server.url + "/health")[1]["replicas"]]
    victim = in_flight.index(max(in_flight))  # one prefix: both on one replica
    assert in_flight[victim] == 2, in_flight
    pid = decoder_pid(server, victim)
    os.kill(pid, signal.SIGKILL)
    for connection, response in connections:
        rest = response.read().decode()  # ends at once with the error, not at max_tokens
        assert "the decoder process crashed" in rest
        connection.close()
    status, health = get_json(server.url + "/health")
    # The other replica serves on while this one restarts (status ok, the lost one named).
    assert status == 200
    assert chat(server, [SYSTEM, {"role": "user", "content": "still there?"}], 4)["choices"][0]["token_ids"]
    assert wait_for(lambda: get_json(server.url + "/health")[1]["replicas"][victim]["status"] == "ready", 180), \
        server.log_text()
    assert decoder_pid(server, victim) != pid
    # It rejoined with an empty cache (the router forgot what the lost process held).
    assert replica_series(server, "antiphon_replica_prefix_blocks_indexed")[victim] == 0


def test_replicas_as_local_processes_without_ray(tiny_llama, offline, tmp_path):
    local = ServerProcess(tiny_llama, "--data-parallel-size", "2", "--routing-policy", "round-robin",
                          log_dir=tmp_path)
    try:
        for n in range(2):  # round-robin: one on each replica
            conversation = [{"role": "user", "content": f"hello {n}"}]
            assert chat(local, conversation)["choices"][0]["token_ids"] == greedy_offline(offline, conversation,
                                                                                        16).token_ids
        assert replica_series(local, "antiphon_replica_requests_routed_total") == [1, 1]
        assert "Ray" not in local.log_text()
        # Each replica's decoder is a child of the server, as in the single engine.
        assert len(local.worker_pids("decoder")) == 2
    finally:
        assert local.stop() == 0, local.log_text()


def test_an_omni_models_answers_are_spoken_by_the_talker_beside_their_decoder(tmp_path):
    from tests.qwen3_omni_models import save_tiny_qwen3_omni
    from tests.test_server_qwen3_omni import MAX_CODES, spoken_body

    omni = save_tiny_qwen3_omni(tmp_path / "qwen3_omni")
    speaking = ServerProcess(omni, "--data-parallel-size", "2", "--routing-policy", "round-robin",
                             "--max-spoken-codes", str(MAX_CODES), "--talker-threads", "1", log_dir=tmp_path,
                             voice=True)
    try:
        answers = []
        for _ in range(2):  # round-robin: one on each replica, each spoken by that replica's talker
            status, answer = post_json(speaking.url + "/v1/chat/completions", spoken_body("wav"))
            assert status == 200, answer
            answers.append(answer["choices"][0]["message"]["audio"])
        assert replica_series(speaking, "antiphon_replica_requests_routed_total") == [1, 1]
        assert answers[0]["transcript"] == answers[1]["transcript"]  # the thinker's greedy text
        # Audio came back for both: each decoder's rows reached the talker its answer was bound to
        # (a talker beside another decoder would never hear them, and the answer would time out).
        # Sampled codes may differ between replicas: a process picks its float32 kernels at load.
        for audio in answers:
            samples, rate = read_wav(base64.b64decode(audio["data"]))
            assert rate == 24000 and samples.size > rate // 10
        assert wait_for(lambda: speaking.metric("antiphon_voice_spoken_answers_held") == 0, 10)
    finally:
        assert speaking.stop() == 0, speaking.log_text()
