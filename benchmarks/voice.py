"""Voice benchmark: spoken questions over the Realtime WebSocket against `antiphon serve`
(voice on, the default model), the way a voice client talks to it, in one run.

    python benchmarks/voice.py              # about 3 minutes
    python benchmarks/voice.py --turns 3    # quicker

Each session speaks questions (said by the Piper voice, sent as 24 kHz PCM in 100 ms chunks
at real-time pace, server VAD with silence_duration_ms 300) and waits for the spoken answer.
Voice-to-voice latency runs from the end of the question's speech to the first audio byte
of the answer, split into: VAD wait (speech end -> speech_stopped), recognition
(-> transcription completed), first text token (-> first transcript delta), first clause
(-> the transcript completes the talker's first clause) and first synthesized chunk
(-> first output_audio.delta). p50/p90 at 1 and at 4 concurrent sessions.
Then: synthesis real-time factor (/v1/audio/speech wall time / audio length) and text TTFT
of a short text-only response, alone and while two sessions are getting spoken answers.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.audio_formats import encode_audio  # noqa: E402
from tests.server_harness import ServerProcess  # noqa: E402
from tests.spoken import said_naturally  # noqa: E402
from workers.speech.clause_splitter import ClauseSplitter  # noqa: E402

RATE = 24000
CHUNK_S = 0.1
QUESTIONS = ["What color is the sky?", "What is the capital of France?", "Tell me a fun fact about cats.",
             "What is the largest planet?", "How do I make a cup of tea?", "Why is the ocean salty?"]
STAGES = ("vad_wait", "recognition", "first_text", "first_clause", "first_audio")


async def spoken_turn(ws, question: str) -> dict:
    """Speaks one question and times its answer; the stage times in seconds."""
    import websockets  # noqa: F401  (the caller's connection)

    speech = said_naturally(question, RATE)
    audio = np.concatenate([np.zeros(int(0.3 * RATE), np.float32), speech, np.zeros(int(1.2 * RATE), np.float32)])
    speech_end_s = 0.3 + len(speech) / RATE
    marks: dict[str, float] = {}
    splitter = ClauseSplitter()

    async def speak() -> None:
        started = time.perf_counter()
        marks["speech_end"] = started + speech_end_s
        step = int(CHUNK_S * RATE)
        for index, start in enumerate(range(0, len(audio), step)):
            chunk = base64.b64encode(encode_audio(audio[start:start + step], "audio/pcm")).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            # Real-time pace, on a clock: sends do not drift.
            await asyncio.sleep(max(0.0, started + (index + 1) * CHUNK_S - time.perf_counter()))

    speaker = asyncio.create_task(speak())
    try:
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 120))
            now, kind = time.perf_counter(), event["type"]
            if kind == "input_audio_buffer.speech_stopped":
                marks.setdefault("stopped", now)
            elif kind == "conversation.item.input_audio_transcription.completed":
                marks.setdefault("transcribed", now)
            elif kind == "response.output_audio_transcript.delta":
                marks.setdefault("first_text", now)
                if splitter.feed(event["delta"]):
                    marks.setdefault("first_clause", now)
            elif kind == "response.output_audio.delta":
                marks.setdefault("first_audio", now)
                marks.setdefault("first_clause", now)  # a one-clause answer: complete at its end
            elif kind == "response.done":
                break
            elif kind == "error":
                raise RuntimeError(event["error"])
    finally:
        await speaker
    return {"vad_wait": marks["stopped"] - marks["speech_end"],
            "recognition": marks["transcribed"] - marks["stopped"],
            "first_text": marks["first_text"] - marks["transcribed"],
            "first_clause": marks["first_clause"] - marks["first_text"],
            "first_audio": marks["first_audio"] - marks["first_clause"],
            "voice_to_voice": marks["first_audio"] - marks["speech_end"]}


async def voice_session(url: str, turns: int, offset: int) -> list[dict]:
    import websockets

    results = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "session": {
            "output_modalities": ["audio"], "instructions": "Answer in one or two short sentences.",
            "max_output_tokens": 60, "temperature": 0,
            "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}}}}))
        while json.loads(await ws.recv())["type"] != "session.updated":
            pass
        for turn in range(turns):
            results.append(await spoken_turn(ws, QUESTIONS[(offset + turn) % len(QUESTIONS)]))
    return results


async def text_ttft(url: str, rounds: int) -> list[float]:
    import websockets

    times = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()
        for n in range(rounds):
            await ws.send(json.dumps({"type": "response.create", "response": {
                "conversation": "none", "output_modalities": ["text"], "max_output_tokens": 8,
                "input": [{"type": "message", "role": "user",
                           "content": [{"type": "input_text", "text": f"Say hello number {n}."}]}]}}))
            sent, first = time.perf_counter(), None
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "response.output_text.delta" and first is None:
                    first = time.perf_counter()
                if event["type"] == "response.done":
                    break
            times.append(first - sent)
            await asyncio.sleep(0.2)
    return times


def synthesis_rtf(base_url: str) -> float:
    text = ("The lighthouse keeper climbed the stairs every evening. He lit the lamp, wound the clock, "
            "and watched the ships pass far out at sea.")
    body = json.dumps({"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"}).encode()
    request = urllib.request.Request(base_url + "/v1/audio/speech", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        pcm = response.read()
    return (time.perf_counter() - started) / (len(pcm) / 2 / RATE)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def run(server: ServerProcess, turns: int) -> None:
    rows = []
    for sessions in (1, 4):
        per_session = max(1, turns // sessions) if sessions > 1 else turns
        results = await asyncio.gather(*(voice_session(server.ws_url, per_session, i * 2) for i in range(sessions)))
        flat = [r for session in results for r in session]
        rows.append((sessions, flat))
    print("\n| sessions | turns | voice-to-voice p50 / p90 (ms) | " + " | ".join(f"{s} p50" for s in STAGES) + " |")
    print("|---|---|---|" + "---|" * len(STAGES))
    for sessions, flat in rows:
        v2v = [r["voice_to_voice"] * 1000 for r in flat]
        stages = " | ".join(f"{statistics.median(r[s] for r in flat) * 1000:.0f}" for s in STAGES)
        print(f"| {sessions} | {len(flat)} | {percentile(v2v, 50):.0f} / {percentile(v2v, 90):.0f} | {stages} |")
    rtf = synthesis_rtf(server.url)
    alone = await text_ttft(server.ws_url, 8)
    speaking = [asyncio.create_task(voice_session(server.ws_url, 2, i)) for i in range(2)]
    await asyncio.sleep(2.0)  # the spoken turns are under way
    beside = await text_ttft(server.ws_url, 8)
    await asyncio.gather(*speaking)
    print(f"\nsynthesis real-time factor (/v1/audio/speech, 2 sentences): {rtf:.3f}")
    print(f"text TTFT p50: alone {statistics.median(alone) * 1000:.0f} ms, beside two spoken answers "
          f"{statistics.median(beside) * 1000:.0f} ms ({statistics.median(beside) / statistics.median(alone):.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=8, help="spoken turns at one session (and in all at four)")
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    args = parser.parse_args()
    if args.url:
        server = type("Running", (), {"url": args.url, "ws_url": args.url.replace("http", "ws", 1) + "/v1/realtime"})
        asyncio.run(run(server, args.turns))
        return
    with tempfile.TemporaryDirectory() as logs:
        server = ServerProcess(None, log_dir=Path(logs), voice=True)
        try:
            asyncio.run(run(server, args.turns))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
