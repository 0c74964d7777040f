"""Qwen3-Omni's thinker through the real server (frontend, encoder and decoder processes).

The model hears an `input_audio` part and sees an image beside it (deepstack rows travel from
the encoder process to the decoder as wide item rows); HTTP answers equal transformers' greedy
tokens, and a Realtime response with the same clip answers as HTTP does.
"""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from engine.audio_formats import read_wav
from tests.omni_reference import hf_omni_thinker_greedy
from tests.qwen3_omni_models import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, save_tiny_qwen3_omni
from tests.server_harness import ServerProcess, post_json
from tests.test_server_omni import MAX_TOKENS, audio_part, body, png_url, tone_wav


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    return save_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3-omni") / "qwen3_omni")


@pytest.fixture(scope="module")
def server(omni, tmp_path_factory):
    process = ServerProcess(omni, log_dir=tmp_path_factory.mktemp("logs"))
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
