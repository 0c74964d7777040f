"""The chat page in a real headless Chromium (Debian's), driven by Playwright, against the real server."""

import json
import subprocess
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.server_harness import ServerProcess

BROWSER_DIR = Path(__file__).resolve().parent / "browser"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    process = ServerProcess(tiny_llama, log_dir=tmp_path_factory.mktemp("logs"))
    yield process
    process.stop()


def test_chat_page_streams_the_answer_in_a_browser(server, tiny_llama, tmp_path):
    assert (BROWSER_DIR / "node_modules" / "playwright-core").is_dir(), "run scripts/install.sh (npm ci)"
    screenshot = tmp_path / "chat.png"
    result = subprocess.run(["node", str(BROWSER_DIR / "chat_page.mjs"), server.url + "/", "hello", str(screenshot)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    page = json.loads(result.stdout.strip().splitlines()[-1])

    expected = LLM(str(tiny_llama), num_kv_blocks=64).chat(
        [{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=40))[0]
    assert page["answer"] == expected.text
    # The answer grew in front of the user, piece by piece.
    growing = [p for p in page["partials"] if p and expected.text.startswith(p) and p != expected.text]
    assert len(growing) >= 3
    assert page["panel"]["ttft"].endswith("ms")
    assert page["panel"]["outTokens"] == str(len(expected.token_ids))
    assert page["stopDisabled"] is True
    assert page["consoleErrors"] == []
    assert screenshot.stat().st_size > 10_000


def test_the_page_hears_a_spoken_question_and_speaks_the_answer(voice_server, tmp_path):
    """Chromium's fake microphone says the question; the page shows its transcript and plays
    the spoken answer (hands-free, server VAD)."""
    import numpy as np

    from engine.audio_formats import write_wav
    from tests.spoken import said_naturally, words

    question = "What is the capital of France?"
    rate = 48000
    audio = np.concatenate([np.zeros(rate, np.float32), said_naturally(question, rate),
                            np.zeros(3 * rate, np.float32)])
    wav = tmp_path / "question.wav"
    wav.write_bytes(write_wav(audio, rate))
    screenshot = tmp_path / "voice.png"
    result = subprocess.run(["node", str(BROWSER_DIR / "voice_page.mjs"), voice_server.url + "/", str(wav),
                             str(screenshot)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr + voice_server.log_text()
    page = json.loads(result.stdout.strip().splitlines()[-1])
    assert words(page["transcript"]) == words(question), page
    assert "paris" in page["answer"].lower(), page
    assert page["audioBytes"] > 24000, page  # more than half a second of the answer was played
    assert page["errors"] == [] and page["consoleErrors"] == [], page
    assert screenshot.stat().st_size > 10_000
