"""An omni model through the real server (frontend, encoder and decoder processes), tiny Qwen2.5-Omni.

The model hears `input_audio` parts itself: they are encoder items, not transcripts. Answers
equal transformers' greedy tokens for the same clip (and with an image beside it); usage counts
audio tokens; the same clip again is a prefix-cache hit that is not encoded again; bad audio is
a 400 naming the problem and harms nobody else.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import PIL.Image
import pytest

from engine.audio_formats import read_wav, write_wav
from tests.omni_models import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, save_tiny_omni
from tests.omni_reference import hf_omni_thinker_greedy
from tests.server_harness import ServerProcess, post_json

MAX_TOKENS = 6


def tone_wav(seed: int, seconds: float = 1.2, rate: int = 16000) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return write_wav((0.3 * np.sin(2 * np.pi * (180 + 40 * seed) * t) + 0.05 * noise).astype(np.float32), rate)


def audio_part(wav: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def png_url(image: PIL.Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def body(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    return save_tiny_omni("qwen2_5_omni", tmp_path_factory.mktemp("omni") / "qwen2_5_omni")


@pytest.fixture(scope="module")
def server(omni, tmp_path_factory):
    process = ServerProcess(omni, log_dir=tmp_path_factory.mktemp("logs"))
    yield process
    assert process.stop() == 0, process.log_text()


def reference(omni, parts: list[str], images=(), wavs=()) -> list[int]:
    from transformers import AutoTokenizer

    template = "".join(parts)
    prompt = AutoTokenizer.from_pretrained(omni).apply_chat_template(
        [{"role": "user", "content": template}], add_generation_prompt=True, tokenize=False)
    return hf_omni_thinker_greedy(omni, prompt, list(images), [read_wav(wav)[0] for wav in wavs], MAX_TOKENS)


def test_input_audio_is_heard_by_the_model_and_answers_equal_transformers(server, omni):
    wav = tone_wav(1)
    content = [audio_part(wav), {"type": "text", "text": "What was that?"}]
    status, answer = post_json(server.url + "/v1/chat/completions", body(content))
    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == reference(omni, [AUDIO_PLACEHOLDER, "What was that?"], wavs=[wav])
    audio_tokens = answer["usage"]["prompt_tokens_details"]["audio_tokens"]
    assert audio_tokens == 30  # 1.2 s: 120 mel frames, halved twice
    # The same clip again: the prefix cache covers it, and it is not encoded again.
    encoded = server.metric("antiphon_encoder_items_requested_total")
    status, again = post_json(server.url + "/v1/chat/completions", body(content))
    assert again["choices"][0]["token_ids"] == answer["choices"][0]["token_ids"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > audio_tokens
    assert server.metric("antiphon_encoder_items_requested_total") == encoded


def test_an_image_and_a_clip_in_one_message(server, omni):
    image = PIL.Image.fromarray(np.random.default_rng(3).integers(0, 256, (84, 112, 3), dtype=np.uint8))
    wav = tone_wav(2, 0.8, rate=16000)
    content = [{"type": "image_url", "image_url": {"url": png_url(image)}}, {"type": "text", "text": "and"},
               audio_part(wav)]
    status, answer = post_json(server.url + "/v1/chat/completions", body(content))
    assert status == 200, answer
    expected = reference(omni, [IMAGE_PLACEHOLDER, "and", AUDIO_PLACEHOLDER], [image], [wav])
    assert answer["choices"][0]["token_ids"] == expected
    details = answer["usage"]["prompt_tokens_details"]
    assert details["image_tokens"] == 12 and details["audio_tokens"] == 20


@pytest.mark.parametrize("part,code", [
    ({"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}, "invalid_audio"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF....").decode(), "format": "wav"}},
     "invalid_audio"),
    (audio_part(tone_wav(4, 31.0, rate=8000)), "audio_too_long"),
])
def test_bad_audio_is_a_400_naming_the_problem(server, part, code):
    status, answer = post_json(server.url + "/v1/chat/completions", body([part, {"type": "text", "text": "hi"}]))
    assert (status, answer["error"]["code"]) == (400, code), answer
    status, answer = post_json(server.url + "/v1/chat/completions", body("text still works"))
    assert status == 200, answer


async def test_realtime_input_audio_is_heard_and_answers_like_http(server):
    from engine.audio_formats import to_pcm16
    from frontend.client import RealtimeClient, audio_part as realtime_audio_part

    # Realtime's pcm16 is 24 kHz; the same clip over HTTP as a 24 kHz WAV is resampled the same way.
    wav = tone_wav(5, 1.0, rate=24000)
    samples, _ = read_wav(wav)
    content = [audio_part(wav), {"type": "text", "text": "Answer that."}]
    status, plain = post_json(server.url + "/v1/chat/completions", body(content))
    assert status == 200, plain
    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0, max_output_tokens=MAX_TOKENS)
        response = await client.create_response(
            [{"role": "user", "content": [realtime_audio_part(to_pcm16(samples).tobytes()), "Answer that."]}])
        text = "".join([delta async for delta in response])
    assert text == plain["choices"][0]["message"]["content"]


async def test_a_committed_turn_is_heard_without_a_recognizer(server):
    # This server runs --no-voice: a cascade would refuse audio in; the omni model hears it.
    from engine.audio_formats import to_pcm16
    from frontend.client import RealtimeClient

    samples, _ = read_wav(tone_wav(6, 1.0, rate=24000))
    encoded = server.metric("antiphon_encoder_items_requested_total")
    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0, max_output_tokens=MAX_TOKENS,
                                    audio={"input": {"turn_detection": None}})
        await client.append_audio(to_pcm16(samples).tobytes())
        await client.commit_audio()
        response = await client.create_response()
        text = "".join([delta async for delta in response])
    assert response.status == "incomplete" and text  # stopped at max_output_tokens
    assert server.metric("antiphon_encoder_items_requested_total") == encoded + 1


async def test_a_realtime_clip_longer_than_the_model_hears_is_refused_when_kept(server):
    import websockets

    from engine.audio_formats import to_pcm16

    audio = base64.b64encode(to_pcm16(np.zeros(24000 * 31, np.float32)).tobytes()).decode()
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        async def next_of(kind):
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == kind:
                    return event
        await next_of("session.created")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}}))
        error = await next_of("error")
        assert error["error"]["code"] == "audio_too_long", error
