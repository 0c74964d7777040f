"""Qwen3-Omni through the real server (frontend, encoder, decoder and talker processes).

The model hears an `input_audio` part and sees an image beside it (deepstack rows travel from
the encoder process to the decoder as wide item rows); HTTP answers equal transformers' greedy
tokens, and a Realtime response with the same clip answers as HTTP does. With voice on, the
talker process runs the model's talker, code predictor and code2wav: a seeded spoken answer's
audio is the offline LLM's frames through the same chunked code2wav, and Realtime's audio is
HTTP's.
"""

from __future__ import annotations

import base64

import numpy as np
import PIL.Image
import pytest

from engine.audio_formats import read_wav
from tests.omni_reference import hf_omni_thinker_greedy
from tests.qwen3_omni_models import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, save_tiny_qwen3_omni
from tests.server_harness import ServerProcess, post_json
from tests.test_server_omni import MAX_TOKENS, audio_part, body, png_url, tone_wav


MAX_CODES, SEED = 30, 11
QUESTION = "Say something."


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    return save_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3-omni") / "qwen3_omni")


@pytest.fixture(scope="module")
def server(omni, tmp_path_factory):
    process = ServerProcess(omni, "--max-spoken-codes", str(MAX_CODES), "--talker-threads", "1",
                            log_dir=tmp_path_factory.mktemp("logs"), voice=True)
    yield process
    assert process.stop() == 0, process.log_text()


def reference(omni, parts: list[str], images=(), wavs=()) -> list[int]:
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(omni).apply_chat_template(
        [{"role": "user", "content": "".join(parts)}], add_generation_prompt=True, tokenize=False)
    return hf_omni_thinker_greedy(omni, prompt, list(images), [read_wav(wav)[0] for wav in wavs], MAX_TOKENS)


def test_an_image_and_a_clip_are_answered_as_transformers_answers(server, omni):
    image = PIL.Image.fromarray(np.random.default_rng(5).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    wav = tone_wav(3, 1.3)
    content = [{"type": "image_url", "image_url": {"url": png_url(image)}}, audio_part(wav),
               {"type": "text", "text": "What is this?"}]
    status, answer = post_json(server.url + "/v1/chat/completions", body(content))
    assert status == 200, answer
    expected = reference(omni, [IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER, "What is this?"], [image], [wav])
    assert answer["choices"][0]["token_ids"] == expected
    assert answer["usage"]["prompt_tokens_details"]["audio_tokens"] > 0


async def test_realtime_input_audio_answers_like_http(server):
    from engine.audio_formats import to_pcm16
    from frontend.client import RealtimeClient, audio_part as realtime_audio_part

    wav = tone_wav(7, 1.0, rate=24000)
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


def spoken_body(audio_format: str) -> dict:
    return {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "seed": SEED, "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": audio_format}}


def test_a_spoken_answer_is_the_offline_llms_frames_through_code2wav(server, omni):
    import msgspec

    from engine import LLM, SamplingParams
    from engine.adapters.qwen3_omni_talker import Qwen3TalkerSpec
    from engine.audio_formats import to_pcm16

    llm = LLM(str(omni), quantization="none", omni_speech=True)
    # The server's talker sampling: the checkpoint's own, seeded by the request.
    talker = msgspec.structs.replace(Qwen3TalkerSpec.default_sampling, seed=SEED, max_tokens=MAX_CODES)
    offline, = llm.chat([{"role": "user", "content": QUESTION}],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=SEED),
                        voice="ethan", talker_params=talker)
    assert offline.codec_token_ids
    stream = llm._speech.stage.codec.stream()
    expected = np.concatenate([*(c.numpy() for c in stream.feed(offline.codec_token_ids)), stream.finish().numpy()])
    status, answer = post_json(server.url + "/v1/chat/completions", spoken_body("wav"))
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert message["audio"]["transcript"] == offline.text
    samples, rate = read_wav(base64.b64decode(message["audio"]["data"]))
    assert rate == 24000 and samples.size == expected.size > 0
    assert "on 1 CPU thread(s)" in server.log_text()  # --talker-threads
    np.testing.assert_allclose(samples, to_pcm16(expected).astype(np.float32) / 32767, atol=2 / 32767)
    # An unknown voice names the model's speakers.
    status, refused = post_json(server.url + "/v1/chat/completions", {**spoken_body("wav"), "audio": {
        "voice": "alloy", "format": "wav"}})
    assert (status, refused["error"]["param"]) == (400, "audio.voice") and "ethan" in refused["error"]["message"]


async def test_realtime_speaks_as_http_does(server):
    from frontend.client import RealtimeClient

    status, plain = post_json(server.url + "/v1/chat/completions", spoken_body("pcm16"))
    assert status == 200, plain
    async with RealtimeClient(server.ws_url) as client:
        await client.update_session(temperature=0, max_output_tokens=MAX_TOKENS, seed=SEED,
                                    audio={"output": {"voice": "ethan"}}, output_modalities=["audio"])
        response = await client.create_response([{"role": "user", "content": QUESTION}])
        chunks = [chunk async for chunk in response.audio_chunks()]
        await response.wait()
    assert response.text == plain["choices"][0]["message"]["audio"]["transcript"]
    assert b"".join(chunks) == base64.b64decode(plain["choices"][0]["message"]["audio"]["data"])
