"""Images through the real server (frontend, encoder and decoder processes) on a tiny Qwen2-VL.

Answers equal transformers' greedy tokens; usage counts image tokens; the encoder's global
cache serves a repeated image; bad images are 400s that harm nobody else; and an encoder
killed mid-request fails only the requests that needed it while text keeps flowing.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import os
import signal
import threading

import numpy as np
import PIL.Image
import pytest

from tests.server_harness import ServerProcess, get_json, post_json, wait_for
from tests.tiny_vlms import save_tiny_vlm
from tests.vlm_reference import hf_vlm_greedy

MAX_TOKENS = 6


def picture(seed: int, size=(112, 84)) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


def data_url(image: PIL.Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url: str, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def body(messages, **extra) -> dict:
    return {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return save_tiny_vlm("qwen2_vl", tmp_path_factory.mktemp("vlm") / "qwen2_vl")


@pytest.fixture(scope="module")
def server(vlm, tmp_path_factory):
    process = ServerProcess(vlm, "--worker-timeout", "5", "--max-worker-restarts", "5",
                            log_dir=tmp_path_factory.mktemp("logs"))
    yield process
    assert process.stop() == 0, process.log_text()


def reference(vlm, image, text="What is in this picture?") -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
        add_generation_prompt=True, tokenize=False)
    return hf_vlm_greedy(vlm, prompt, [image], MAX_TOKENS)


def test_image_answers_equal_transformers_and_usage_counts_image_tokens(server, vlm):
    image = picture(1)
    status, answer = post_json(server.url + "/v1/chat/completions", body(image_message(data_url(image))))
    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == reference(vlm, image)
    assert answer["usage"]["prompt_tokens_details"]["image_tokens"] == 12
    # The same image again: the prefix cache covers it (and it is not encoded again).
    encoded = server.metric("antiphon_encoder_items_requested_total")
    status, again = post_json(server.url + "/v1/chat/completions", body(image_message(data_url(image))))
    assert again["choices"][0]["token_ids"] == answer["choices"][0]["token_ids"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 12
    assert server.metric("antiphon_encoder_items_requested_total") == encoded


def test_streamed_answer_with_a_jpeg_equals_the_plain_one(server):
    image = picture(2)
    url = data_url(image, "JPEG")
    status, plain = post_json(server.url + "/v1/chat/completions", body(image_message(url)))
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    streamed_body = body(image_message(url), stream=True, stream_options={"include_usage": True})
    connection.request("POST", "/v1/chat/completions", json.dumps(streamed_body), {"Content-Type": "application/json"})
    events = [line[6:] for line in connection.getresponse().read().decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [t for e in events for c in json.loads(e)["choices"] for t in c["delta"].get("token_ids", [])]
    assert streamed == plain["choices"][0]["token_ids"]
    assert json.loads(events[-1])["usage"]["prompt_tokens_details"]["image_tokens"] == 12


def test_same_image_in_another_conversation_is_an_encoder_cache_hit(server):
    image = picture(3)
    before = server.metric("antiphon_encoder_items_encoded_total")
    hits = server.metric("antiphon_encoder_cache_hits_total")
    for text in ("First question?", "A different question, so no prefix hit past the image."):
        status, answer = post_json(server.url + "/v1/chat/completions",
                                   body([{"role": "system", "content": text}, *image_message(data_url(image))]))
        assert status == 200, answer
    assert wait_for(lambda: server.metric("antiphon_encoder_items_encoded_total") == before + 1, timeout=5)
    assert wait_for(lambda: server.metric("antiphon_encoder_cache_hits_total") == hits + 1, timeout=5)
    # The frontend knew the encoder held it: the second time its pixels were not sent.
    sent_cached = server.metric("antiphon_encoder_items_sent_cached_total")
    status, answer = post_json(server.url + "/v1/chat/completions",
                               body([{"role": "system", "content": "A third one."}, *image_message(data_url(image))]))
    assert status == 200, answer
    assert server.metric("antiphon_encoder_items_sent_cached_total") == sent_cached + 1


@pytest.mark.parametrize("url,code", [
    ("data:image/png;base64,AAAA", "invalid_image"),
    ("data:image/png;base64,not base64!", "invalid_image_url"),
    ("http://127.0.0.1:1/cat.png", "remote_url_not_supported"),
    ("file:///etc/passwd", "local_file_not_allowed"),
])
def test_bad_images_are_400s_naming_the_problem(server, url, code):
    status, answer = post_json(server.url + "/v1/chat/completions", body(image_message(url)))
    assert status == 400, answer
    assert answer["error"]["code"] == code
    assert get_json(server.url + "/health")[0] == 200


def test_decompression_bomb_and_too_many_images_are_refused(server):
    # 16.4 M pixels (over the default 16 M) of one colour: a few kilobytes of PNG.
    bomb = PIL.Image.new("RGB", (4000, 4100), (10, 200, 30))
    status, answer = post_json(server.url + "/v1/chat/completions", body(image_message(data_url(bomb))))
    assert (status, answer["error"]["code"]) == (400, "image_too_many_pixels"), answer
    url = data_url(picture(5, (28, 28)))
    nine = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 9}]
    status, answer = post_json(server.url + "/v1/chat/completions", body(nine))
    assert (status, answer["error"]["code"]) == (400, "too_many_images"), answer


def test_text_only_requests_still_work_on_a_vision_model(server):
    status, answer = post_json(server.url + "/v1/chat/completions", body([{"role": "user", "content": "Hi"}]))
    assert status == 200 and len(answer["choices"][0]["token_ids"]) == MAX_TOKENS
    assert "image_tokens" not in answer["usage"]["prompt_tokens_details"]


def test_encoder_killed_mid_request_fails_only_image_requests(server):
    (encoder,) = server.worker_pids("encoder")
    os.kill(encoder, signal.SIGSTOP)  # a busy encoder: the image request waits for it
    results = {}

    def ask(name, messages):
        results[name] = post_json(server.url + "/v1/chat/completions", body(messages))

    waiting = threading.Thread(target=ask, args=("image", image_message(data_url(picture(6)))))
    waiting.start()
    try:
        # Text goes on while the image waits for the encoder.
        ask("text", [{"role": "user", "content": "Still there?"}])
        assert results["text"][0] == 200, results["text"]
        assert waiting.is_alive()
    finally:
        os.kill(encoder, signal.SIGKILL)
    waiting.join(timeout=60)
    status, answer = results["image"]
    assert status == 500 and answer["error"]["code"] == "engine_error", answer
    assert "encoder" in answer["error"]["message"]
    assert wait_for(lambda: server.worker_pids("encoder") and encoder not in server.worker_pids("encoder")
                    and get_json(server.url + "/health")[0] == 200, timeout=60)
    status, answer = post_json(server.url + "/v1/chat/completions", body(image_message(data_url(picture(6)))))
    assert status == 200, answer
    assert wait_for(lambda: server.metric("antiphon_kv_blocks_used") == 0, timeout=5)
    assert server.metric("antiphon_engine_requests_registered") == 0


async def test_realtime_input_image_answers_like_http(server):
    from frontend.client import RealtimeClient, image_part

    image = picture(8)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    status, plain = post_json(server.url + "/v1/chat/completions", body(image_message(data_url(image))))
    assert status == 200, plain
    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0, max_output_tokens=MAX_TOKENS)
        response = await client.create_response(
            [{"role": "user", "content": [image_part(buffer.getvalue()), "What is in this picture?"]}])
        text = "".join([delta async for delta in response])
    assert response.status == "incomplete"  # stopped at max_output_tokens, like the HTTP answer
    assert text == plain["choices"][0]["message"]["content"]


async def test_realtime_bad_image_is_an_error_event_and_the_session_goes_on(server):
    import websockets

    async with websockets.connect(server.ws_url) as ws:
        async def next_of(kind):
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if event["type"] == kind:
                    return event

        await next_of("session.created")
        for part in ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                     {"type": "input_image"}):
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [part, {"type": "input_text", "text": "hi"}]}}))
            event = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if event["type"] == "conversation.item.added":
                await ws.send(json.dumps({"type": "response.create"}))
                error = await next_of("error")
                assert error["error"]["code"] == "invalid_image"
                await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": event["item"]["id"]}))
                await next_of("conversation.item.deleted")
            else:
                assert event["type"] == "error" and event["error"]["code"] == "invalid_value", event
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}))
        # Greedy: a sampled answer may end at once (EOS), and "completed" would hide nothing.
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 2, "temperature": 0}}))
        done = await next_of("response.done")
        assert done["response"]["status"] == "incomplete"


def test_chat_page_attaches_an_image_and_streams_the_answer(server, tmp_path):
    import subprocess
    from pathlib import Path

    browser_dir = Path(__file__).resolve().parent / "browser"
    image_path = tmp_path / "photo.png"
    picture(9).save(image_path)
    screenshot = tmp_path / "chat-image.png"
    result = subprocess.run(["node", str(browser_dir / "chat_page.mjs"), server.url + "/", "What is this?",
                             str(screenshot), str(image_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    page = json.loads(result.stdout.strip().splitlines()[-1])
    assert page["errors"] == [] and page["consoleErrors"] == []
    assert page["userImages"] == 1
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture(9))}},
                                             {"type": "text", "text": "What is this?"}]}]
    status, http = post_json(server.url + "/v1/chat/completions",
                             {"messages": messages, "max_tokens": 40, "temperature": 0})
    assert page["answer"] == http["choices"][0]["message"]["content"]
    assert screenshot.stat().st_size > 10_000


def test_image_limits_are_flags(vlm, tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    picture(10).save(allowed / "ok.png")
    picture(11, (600, 600)).save(tmp_path / "outside.png")
    server = ServerProcess(vlm, "--allowed-local-media-path", str(allowed), "--max-image-pixels", "200000",
                           "--max-images-per-request", "2", log_dir=tmp_path)
    try:
        status, answer = post_json(server.url + "/v1/chat/completions", body(image_message(str(allowed / "ok.png"))))
        assert status == 200, answer
        for url, code in [(str(tmp_path / "outside.png"), "local_file_not_allowed"),
                          (data_url(picture(12, (500, 500))), "image_too_many_pixels")]:
            status, answer = post_json(server.url + "/v1/chat/completions", body(image_message(url)))
            assert (status, answer["error"]["code"]) == (400, code), answer
        three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture(1))}}] * 3}]
        status, answer = post_json(server.url + "/v1/chat/completions", body(three))
        assert (status, answer["error"]["code"]) == (400, "too_many_images"), answer
    finally:
        assert server.stop() == 0


def test_an_image_larger_than_the_encoder_budget_is_a_400(vlm, tmp_path):
    server = ServerProcess(vlm, "--encoder-cache-size", "8", log_dir=tmp_path)  # the image makes 12
    try:
        status, answer = post_json(server.url + "/v1/chat/completions", body(image_message(data_url(picture(1)))))
        assert (status, answer["error"]["code"]) == (400, "image_too_large"), answer
        status, answer = post_json(server.url + "/v1/chat/completions", body([{"role": "user", "content": "Hi"}]))
        assert status == 200, answer
    finally:
        assert server.stop() == 0


def test_a_large_photo_fits_the_default_message_size_of_a_vision_model(server):
    photo = picture(13, (1200, 900))  # noise: ~3 MB as PNG, over the text-only 1 MiB
    url = data_url(photo)
    assert len(url) > 2 << 20
    status, answer = post_json(server.url + "/v1/chat/completions", body(image_message(url)))
    assert status == 200, answer


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_every_family_serves_concurrent_image_requests_with_async_scheduling(family, tmp_path):
    """Qwen2.5-VL and LLaVA through the real server too, with asynchronous scheduling on (step
    N+1 scheduled while step N runs), four requests with different images at once: every
    answer equals transformers' greedy tokens for its own image."""
    vlm = save_tiny_vlm(family, tmp_path / family)
    server = ServerProcess(vlm, "--async-scheduling", "on", log_dir=tmp_path)
    try:
        images = [picture(40 + i) for i in range(4)]
        answers: dict[int, tuple[int, dict]] = {}

        def ask(index: int) -> None:
            answers[index] = post_json(server.url + "/v1/chat/completions",
                                       body(image_message(data_url(images[index]))))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(images))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        for index, image in enumerate(images):
            status, answer = answers[index]
            assert status == 200, answer
            assert answer["choices"][0]["token_ids"] == reference(vlm, image), (family, index)
    finally:
        assert server.stop() == 0, server.log_text()
