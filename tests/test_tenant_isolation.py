"""Tenants (API keys) of one server: what one tenant made, another cannot name, read or
detect by time, and no tenant or client can take all of the shared voice work.

Servers here have two keys, A and B, and nothing else set: isolation is the default.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import threading

import numpy as np
import PIL.Image
import pytest

from frontend.spoken_answers import SpokenAnswerStore
from frontend.tenancy import FairShare, Requester, ShareExhausted
from tests.server_harness import ServerProcess, get_json, post_json, request, wait_for

KEY_A, KEY_B = "tenant-a-secret", "tenant-b-secret"


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def metric(server, name: str, key: str = KEY_A) -> float:
    status, text = request("GET", server.url + "/metrics", headers=auth(key))
    assert status == 200, text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


# ---- the pieces ----------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_spoken_answer_ids_are_random_and_name_a_transcript_only_for_their_tenant():
    store = SpokenAnswerStore(clock=Clock())
    ids = {store.new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == len("audio_") + 32 for i in ids)
    audio_id = store.new_id()
    store.remember("a", audio_id, "A's secret answer", store.expires_at())
    assert store.transcript_of("a", audio_id) == "A's secret answer"
    assert store.transcript_of("b", audio_id) is None
    assert store.transcript_of("", audio_id) is None


def test_spoken_answers_expire_when_expires_at_says_and_are_bounded_per_tenant():
    clock = Clock()
    store = SpokenAnswerStore(per_tenant=3, ttl_s=60, clock=clock)
    first = store.new_id()
    store.remember("a", first, "one", store.expires_at())
    clock.now += 59
    assert store.transcript_of("a", first) == "one"
    clock.now += 1
    assert store.transcript_of("a", first) is None
    kept = []
    for n in range(5):
        kept.append(store.new_id())
        store.remember("a", kept[-1], str(n), store.expires_at())
    store.remember("b", "audio_b", "b's", store.expires_at())
    assert len(store) == 4  # three of A's (the newest), one of B's: A cannot push B's out
    assert [store.transcript_of("a", i) for i in kept] == [None, None, "2", "3", "4"]
    assert store.transcript_of("b", "audio_b") == "b's"


def test_a_fair_share_refuses_a_client_or_tenant_at_its_share_and_serves_the_others():
    share = FairShare("clips", "--max-clips", total=4, per_tenant=2, per_client=1)
    a1, a2, b1 = Requester("a", "10.0.0.1"), Requester("a", "10.0.0.2"), Requester("b", "10.0.0.3")
    held = [share.take(a1)]
    with pytest.raises(ShareExhausted) as refused:
        share.take(a1)
    assert refused.value.scope == "client"
    held.append(share.take(a2))
    with pytest.raises(ShareExhausted) as refused:
        share.take(Requester("a", "10.0.0.9"))
    assert refused.value.scope == "tenant"
    held.append(share.take(b1))
    held.append(share.take(Requester("b", "10.0.0.4")))
    with pytest.raises(ShareExhausted) as refused:
        share.take(Requester("c", "10.0.0.5"))
    assert refused.value.scope == "server"
    for slot in held:
        slot.release()
        slot.release()  # idempotent
    assert share.held == 0 and not share.by_client and not share.by_tenant


# ---- images and the prefix cache: a vision model with two keys -----------------------------

@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    from tests.tiny_vlms import save_tiny_vlm

    vlm = save_tiny_vlm("qwen2_vl", tmp_path_factory.mktemp("vlm") / "qwen2_vl")
    process = ServerProcess(vlm, "--api-key", KEY_A, "--api-key", KEY_B, "--worker-timeout", "5",
                            "--max-worker-restarts", "5", log_dir=tmp_path_factory.mktemp("logs"))
    yield process
    assert process.stop() == 0, process.log_text()


def image_body(seed: int, text: str) -> dict:
    import io

    pixels = np.random.default_rng(seed).integers(0, 256, (84, 112, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": text}]}],
            "max_tokens": 2, "temperature": 0}


def test_an_image_one_tenant_sent_is_encoded_anew_for_another(vlm_server):
    encoded = metric(vlm_server, "antiphon_encoder_items_encoded_total")
    hits = metric(vlm_server, "antiphon_encoder_cache_hits_total")
    sent_cached = metric(vlm_server, "antiphon_encoder_items_sent_cached_total")
    status, answer = post_json(vlm_server.url + "/v1/chat/completions", image_body(11, "A asks."), auth(KEY_A))
    assert status == 200, answer
    status, answer = post_json(vlm_server.url + "/v1/chat/completions", image_body(11, "B asks."), auth(KEY_B))
    assert status == 200, answer
    # B's copy of A's image is B's own entry: encoded again, no hit, its pixels sent.
    assert wait_for(lambda: metric(vlm_server, "antiphon_encoder_items_encoded_total") == encoded + 2, timeout=5)
    assert metric(vlm_server, "antiphon_encoder_cache_hits_total") == hits
    assert metric(vlm_server, "antiphon_encoder_items_sent_cached_total") == sent_cached
    # A's own image again is A's hit, as before.
    status, answer = post_json(vlm_server.url + "/v1/chat/completions", image_body(11, "A again."), auth(KEY_A))
    assert status == 200, answer
    assert metric(vlm_server, "antiphon_encoder_items_sent_cached_total") == sent_cached + 1


def test_two_keys_never_share_prefix_cache_blocks_by_default(vlm_server):
    text = {"messages": [{"role": "user", "content": "A long enough question to fill a few blocks. " * 8}],
            "max_tokens": 2, "temperature": 0}
    status, first = post_json(vlm_server.url + "/v1/chat/completions", text, auth(KEY_A))
    assert status == 200, first
    status, other = post_json(vlm_server.url + "/v1/chat/completions", text, auth(KEY_B))
    assert (other["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0, other["usage"]
    status, again = post_json(vlm_server.url + "/v1/chat/completions", text, auth(KEY_A))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]


def test_metrics_want_an_api_key_when_keys_are_set(vlm_server):
    assert request("GET", vlm_server.url + "/metrics")[0] == 401
    assert request("GET", vlm_server.url + "/metrics", headers=auth("wrong"))[0] == 401
    assert request("GET", vlm_server.url + "/metrics", headers=auth(KEY_B))[0] == 200
    assert get_json(vlm_server.url + "/health")[0] == 200  # health stays open for load balancers


def test_text_is_served_while_the_encoder_restarts(vlm_server):
    (encoder,) = vlm_server.worker_pids("encoder")
    os.kill(encoder, signal.SIGKILL)
    # The killed process vanishes from pgrep before the front end reaps it: wait for the front
    # end to know (its /health turns 503 with the reason), or an image request could still
    # reach the dead encoder and fail with the crash, as it would for any user in that instant.
    def encoder_down() -> bool:
        status, body = get_json(vlm_server.url + "/health")
        return status == 503 and "encoder" in body.get("reason", "")

    assert wait_for(encoder_down, timeout=10)
    # Its successor is held stopped while it starts, so the encoder stays down for as long as
    # the text request takes: text needs only the decoder and must not wait for the encoder.
    def successors() -> list[int]:
        return [pid for pid in vlm_server.worker_pids("encoder") if pid != encoder]

    assert wait_for(successors, timeout=30)
    (successor,) = successors()
    os.kill(successor, signal.SIGSTOP)
    try:
        assert encoder_down()
        status, answer = post_json(vlm_server.url + "/v1/chat/completions",
                                   {"messages": [{"role": "user", "content": "Still there?"}], "max_tokens": 2},
                                   auth(KEY_A))
        assert status == 200, answer
        assert encoder_down()
    finally:
        os.kill(successor, signal.SIGCONT)
    assert wait_for(lambda: get_json(vlm_server.url + "/health")[0] == 200, timeout=60)
    status, answer = post_json(vlm_server.url + "/v1/chat/completions", image_body(12, "After."), auth(KEY_A))
    assert status == 200, answer


# ---- voice: spoken answers and transcriptions with two keys --------------------------------

@pytest.fixture(scope="module")
def voice_tenants(tmp_path_factory):
    process = ServerProcess(None, "--api-key", KEY_A, "--api-key", KEY_B, "--max-transcriptions", "2",
                            log_dir=tmp_path_factory.mktemp("voice-tenant-logs"), voice=True)
    yield process
    process.stop()


def spoken_chat(server, key: str, stream: bool = False) -> str:
    """The audio id of a spoken answer to a short question."""
    body = {"messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 4, "temperature": 0,
            "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}, "stream": stream}
    if not stream:
        status, answer = post_json(server.url + "/v1/chat/completions", body, auth(key))
        assert status == 200, answer
        return answer["choices"][0]["message"]["audio"]["id"]
    status, text = request("POST", server.url + "/v1/chat/completions", body,
                           {"Content-Type": "application/json", **auth(key)}, timeout=120)
    assert status == 200, text
    ids = {json.loads(line[6:])["choices"][0]["delta"]["audio"]["id"] for line in text.splitlines()
           if line.startswith("data: {") and '"audio"' in line}
    assert len(ids) == 1, ids
    return ids.pop()


def send_back(server, key: str, audio_id: str) -> tuple[int, dict]:
    return post_json(server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say one word."}, {"role": "assistant", "audio": {"id": audio_id}},
                     {"role": "user", "content": "Again."}], "max_tokens": 2}, auth(key))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_spoken_answer_id_works_for_its_tenant_and_reads_as_unknown_to_another(voice_tenants, stream):
    audio_id = spoken_chat(voice_tenants, KEY_A, stream)
    status, answer = send_back(voice_tenants, KEY_A, audio_id)
    assert status == 200, answer
    status, foreign = send_back(voice_tenants, KEY_B, audio_id)
    never = "audio_" + "0" * 32
    status_unknown, unknown = send_back(voice_tenants, KEY_B, never)
    assert status == status_unknown == 400
    # Probing learns nothing: B's error for A's id is the error for an id that never was.
    assert foreign["error"]["code"] == unknown["error"]["code"] == "audio_expired"
    assert foreign["error"]["message"].replace(audio_id, "ID") == unknown["error"]["message"].replace(never, "ID")


def test_one_tenant_cannot_take_every_transcription_slot(voice_tenants):
    from engine.audio_formats import write_wav
    from tests.spoken import spoken

    wav = write_wav(spoken("What is the capital of France?"), 16000)
    boundary = "tenantboundary"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--{boundary}\r\n"
            f"Content-Disposition: form-data; name=\"file\"; filename=\"q.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
            ).encode() + wav + f"\r\n--{boundary}--\r\n".encode()

    def transcribe(key: str, source: str = "127.0.0.1") -> tuple[int, str]:
        """From the loopback address `source`: another address is another client."""
        connection = http.client.HTTPConnection("127.0.0.1", voice_tenants.port, timeout=120,
                                                source_address=(source, 0))
        connection.request("POST", "/v1/audio/transcriptions", form,
                           {"Content-Type": f"multipart/form-data; boundary={boundary}", **auth(key)})
        response = connection.getresponse()
        return response.status, response.read().decode()

    (encoder,) = voice_tenants.worker_pids("encoder")
    results: dict[str, tuple[int, str]] = {}
    # A stopped encoder holds every clip sent to it: A's first takes A's share (1 of 2).
    os.kill(encoder, signal.SIGSTOP)
    try:
        first = threading.Thread(target=lambda: results.__setitem__("a1", transcribe(KEY_A)))
        first.start()
        assert wait_for(lambda: metric(voice_tenants, "antiphon_voice_transcriptions_held") == 1, timeout=10)
        status, text = transcribe(KEY_A)
        assert status == 429 and json.loads(text)["error"]["code"] == "voice_busy", text
        assert "API key" in json.loads(text)["error"]["message"]
        # B from A's address: that client holds its share (1 of 2) too.
        status, text = transcribe(KEY_B)
        assert status == 429 and "this client" in json.loads(text)["error"]["message"], text
        other = threading.Thread(target=lambda: results.__setitem__("b", transcribe(KEY_B, "127.0.0.2")))
        other.start()
        assert wait_for(lambda: metric(voice_tenants, "antiphon_voice_transcriptions_held") == 2, timeout=10)
    finally:
        os.kill(encoder, signal.SIGCONT)
    first.join(timeout=120)
    other.join(timeout=120)
    assert results["a1"][0] == 200 and results["b"][0] == 200, results
    assert "france" in json.loads(results["b"][1])["text"].lower()
    assert metric(voice_tenants, "antiphon_voice_transcriptions_held") == 0


def test_a_share_counts_an_ipv6_client_by_its_64_so_new_addresses_do_not_escape_it():
    from frontend.limits import share_holder

    assert share_holder("2001:db8:1:2::5") == share_holder("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert share_holder("2001:db8:1:3::5") != share_holder("2001:db8:1:2::5")
    assert share_holder("::ffff:10.0.0.1") == share_holder("10.0.0.1") == "10.0.0.1"
    assert share_holder("") == ""
