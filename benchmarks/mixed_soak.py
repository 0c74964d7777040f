"""Faults under mixed load: a real `antiphon serve` with voice on, two tenants, honest and
abusive clients, and its workers killed and stopped while the load runs.

    python benchmarks/soak.py --mixed                              # 6-10 minutes on 2 cores
    python benchmarks/soak.py --mixed --minutes 1.5 --clients 4    # a quick look

Starts `python -m frontend.cli serve` on a free loopback port with voice on (Whisper and
Piper around the LLM), two API keys (two tenants), --worker-timeout 5 and a tiny random-weight
Qwen2-VL (tests/tiny_vlms.py; its text is gibberish, which a soak does not mind) so image
requests reach the vision encoder. Every client talks from its own loopback address
(127.0.0.x), so the server's per-client shares tell them apart, with one tenant's key.

Honest clients loop over: text chats through the openai package (plain and streamed), image
chats (random PNGs, half of them from a small pool so the encoder cache hits), tool calls
(tool_choice required), JSON-schema answers, spoken chat answers, Realtime voice turns
(espeak-ng speech, committed by the client or by server VAD; some answers cut short by
response.cancel or by new speech while they are spoken) and clients that vanish mid-answer
(a RST after the first token). Abusive clients: a slow JSON schema (ten string properties with
distinct maxLength values), 1 MiB bodies, a flood of 30 s transcription uploads from one
address, probes of the other tenant's spoken-answer ids (ids its answers really had, and
guesses) and Realtime sessions flooding audio events.

Phases: honest clients only; honest and abusive; then faults under that load: kill -9 of the
decoder, of the encoder and of the talker, each once /health is 200 again, then SIGSTOP of the
encoder past its heartbeat timeout (the server kills and replaces it). Text chats probe the
server while each fault lasts.

Prints per request kind: answered, refused (429 or a busy code), rejected with a clear 4xx,
5xx or server_error events inside the fault windows and outside them, unclear failures (no
error code, a dropped connection, a broken stream) and lost requests; honest clients' TTFT
without and with the abusive ones; RSS of every process and the front end's open descriptors
at start and end; KV blocks, slots and encoder-cache entries after the load; the time from
each fault to /health 200, and whether text flowed while the encoder or the talker was down.
Exits non-zero if a request was lost or failed unclearly, a 5xx came outside a fault window, a
probe read another tenant's answer, a fault was not recovered from, text stopped while the
encoder or talker was down, or the server did not return to idle.

One file on purpose (~970 lines): its clients, phases and verdicts are one scenario, read in
order, that only `soak.py --mixed` runs; what other benchmarks share lives in http_client.py
and soak.py.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil
import websockets

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import http_client  # noqa: E402
from benchmarks.http_client import abort, read_head, sse_events  # noqa: E402
from benchmarks.soak import (free_port, held_gauges, http_get, launch, metrics, ms, percentile,  # noqa: E402
                             process_rss, prompt, wait_for_idle)

KEYS = {"A": "mixed-soak-tenant-a", "B": "mixed-soak-tenant-b"}
TINY_VLM_NAME = "tiny-qwen2-vl-2k-soak"
# The tests' tiny VLM has 512 positions; a tool call's prompt alone takes ~470 of its
# character-sized tokens.
TINY_VLM_POSITIONS = 2048
# Phases' shares of --minutes; the fault phase runs on until every fault is over.
PHASE_SHARES = {"honest": 0.25, "abusive": 0.25, "faults": 0.5}
# Requests alive this long after /health is 200 again still count as inside the fault.
WINDOW_GRACE_S = 2.0
FAULT_RECOVERY_S = 240.0
LOAD_BETWEEN_FAULTS_S = 5.0
# In turn, each once /health is 200 again: the SIGSTOP lasts past --worker-timeout 5.
FAULTS = (("decoder", "SIGKILL"), ("encoder", "SIGKILL"), ("talker", "SIGKILL"), ("encoder", "SIGSTOP"))
PROBE_EVERY_S = 0.5
# Codes that say "not now" (a full server, a fair share taken, a rate): refusals, not failures.
BUSY_CODES = {"too_many_requests", "grammar_busy", "voice_busy", "rate_limit_exceeded", "too_many_responses",
              "too_many_connections"}
# Codes of a server that failed (events carry them with several error types).
SERVER_CODES = {"engine_unavailable", "engine_error", "voice_unavailable", "server_error"}
HONEST_KINDS = {"text-json": 2, "text-sse": 3, "image": 2, "tools": 1, "json-schema": 1, "spoken-chat": 1,
                "voice-turn": 2, "vanish": 1}
# Abusive kinds and how many of each run at once (all of one kind from one address).
# Abusive clients do not wait for Retry-After, but a tight loop of instant refusals measures
# only how fast the load generator can be refused.
ABUSE_PAUSE_S = 0.25
ABUSIVE_KINDS = {"slow-schema": 2, "1mib-body": 2, "transcription-flood": 6, "id-probe": 1, "realtime-flood": 2}
QUESTIONS = ["What is the capital of France?", "Tell me a story about a dragon.", "How far away is the moon?",
             "Which river is the longest?"]
RATE = 24000
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"]}}}]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                                  "sure": {"type": "boolean"}},
                 "required": ["answer", "sure"], "additionalProperties": False}


@dataclass
class Record:
    kind: str
    honest: bool
    phase: str
    started: float
    ended: float | None = None
    # answered | vanished (left on purpose) | refused | rejected (clear 4xx) | server_error |
    # unclear | lost | leak (a probe read another tenant's spoken answer)
    outcome: str = "lost"
    code: str | None = None
    ttft: float | None = None


class Finished(Exception):
    """How a request ended when it did not simply succeed."""

    def __init__(self, outcome: str, code: str | None = None) -> None:
        super().__init__(outcome, code)
        self.outcome, self.code = outcome, code


def error_outcome(status: int, error) -> Finished:
    """A clear error has an OpenAI-style code; a server failure is a 5xx or a server_error
    event; an error without a code is unclear. `status` 0: an event inside a stream."""
    error = error.get("error", error) if isinstance(error, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    where = str(status) if status else "event"
    if not code:
        return Finished("unclear", f"{where} without an error code")
    if status == 429 or code in BUSY_CODES:
        return Finished("refused", f"{where} {code}")
    if status >= 500 or error.get("type") == "server_error" or code in SERVER_CODES:
        return Finished("server_error", f"{where} {code}")
    return Finished("rejected", f"{where} {code}")


@dataclass
class Fault:
    worker: str
    how: str  # SIGKILL | SIGSTOP
    at: float
    healthy_at: float | None = None
    probes: list[Record] = field(default_factory=list)
    note: str = ""

    def window(self, end: float) -> tuple[float, float]:
        return self.at, (self.healthy_at or end) + WINDOW_GRACE_S


@dataclass
class Soak:
    args: argparse.Namespace
    port: int
    server: psutil.Process
    model_name: str
    phase: str = "honest"
    stopping: bool = False
    records: list[Record] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    phase_times: dict[str, float] = field(default_factory=dict)
    rss: dict[str, dict[str, int]] = field(default_factory=dict)  # process_rss at start, honest, end
    fds: dict[str, int] = field(default_factory=dict)  # the front end's open descriptors, likewise
    spoken_ids: dict[str, list[str]] = field(default_factory=lambda: {"A": [], "B": []})
    speech: list[np.ndarray] = field(default_factory=list)  # the questions spoken, 24 kHz
    long_wav: bytes = b""
    images: list[str] = field(default_factory=list)  # data URLs of the shared pool
    huge_text: str = ""  # a prompt of a little under 1 MiB

    def worker_pid(self, worker: str) -> int | None:
        for child in self.server.children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE and f"workers.{worker}_process" in " ".join(child.cmdline()):
                    return child.pid
            except psutil.NoSuchProcess:
                pass
        return None


@dataclass
class Client:
    soak: Soak
    source: str  # its loopback address
    tenant: str
    honest: bool
    rng: random.Random
    openai: object = None

    @property
    def key(self) -> str:
        return KEYS[self.tenant]


# ---- the server ------------------------------------------------------------------------------

def ensure_tiny_vlm() -> Path:
    """The tiny random Qwen2-VL of the tests, built once into the cache directory."""
    from engine.checkpoint import cache_dir, file_lock

    target = cache_dir() / "models" / TINY_VLM_NAME
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(target.parent / f".{TINY_VLM_NAME}.lock"):
            if not (target / "config.json").is_file():
                from tests.tiny_vlms import save_tiny_vlm
                folder = save_tiny_vlm("qwen2_vl", target.with_name(target.name + ".partial"))
                config = json.loads((folder / "config.json").read_text())
                for section in (config, config.get("text_config", {})):
                    if "max_position_embeddings" in section:
                        section["max_position_embeddings"] = TINY_VLM_POSITIONS
                (folder / "config.json").write_text(json.dumps(config, indent=2))
                folder.rename(target)
    return target


def serve_command(args, port: int) -> list[str]:
    return [sys.executable, "-m", "frontend.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", args.model, "--api-key", KEYS["A"], "--api-key", KEYS["B"], "--worker-timeout", "5",
            # Four faults, with room for a crash the load itself may cause.
            "--max-worker-restarts", "10", *args.server_arg]


# ---- HTTP, from a client's own address -------------------------------------------------------

async def send_request(client: Client, path: str, body: bytes, content_type: str = "application/json"):
    # A server that refuses a large body early may close before reading it: its answer is still read.
    return await http_client.send_request("127.0.0.1", client.soak.port, "POST", path, body, content_type=content_type,
                                          api_key=client.key, local_addr=client.source, early_answer=True)


async def post(client: Client, path: str, payload, content_type: str = "application/json") -> tuple[int, dict]:
    """Status and JSON body (an `error` one for a body that is not JSON)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    reader, writer = await send_request(client, path, body, content_type)
    try:
        status, _ = await read_head(reader)
        data = await reader.read()
    finally:
        writer.close()
    return status, parsed(data)


def parsed(data: bytes) -> dict:
    """A JSON body, or an error without a code for one that is not JSON."""
    try:
        return json.loads(data)
    except ValueError:
        return {"error": {"code": None, "message": data[:80].decode("latin-1")}}


async def healthy(soak: Soak) -> bool:
    """/health is 200 and voice is ready (the server stays healthy while only the talker,
    which text does not need, restarts: its `voice` field says so)."""
    try:
        reader, writer = await asyncio.wait_for(
            http_client.send_request("127.0.0.1", soak.port, "GET", "/health", content_type=None), 5)
    except (OSError, TimeoutError):
        return False
    try:
        status, _ = await asyncio.wait_for(read_head(reader), 5)
        body = parsed(await asyncio.wait_for(reader.read(), 5))
        return status == 200 and body.get("voice") == "ready"
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
        return False
    finally:
        writer.close()


def completion_outcome(status: int, answer: dict) -> tuple[str, str | None]:
    if status != 200:
        raise error_outcome(status, answer)
    reason = answer["choices"][0]["finish_reason"]
    if reason not in ("stop", "length", "tool_calls"):
        raise Finished("unclear", f"finish_reason {reason}")
    return "answered", None


def chat(client: Client, max_tokens: int, **extra) -> dict:
    return {"model": client.soak.model_name, "messages": [{"role": "user", "content": prompt(client.rng)}],
            "max_tokens": max_tokens, "temperature": 0.8, "seed": client.rng.randrange(2**31), **extra}


# ---- honest requests -------------------------------------------------------------------------

def openai_error(exc: Exception) -> Finished:
    import openai

    if isinstance(exc, openai.APIStatusError):
        return error_outcome(exc.status_code, exc.body)
    if isinstance(exc, openai.APIConnectionError):
        return Finished("unclear", f"connection: {exc.__cause__ or exc}"[:80])
    return error_outcome(0, exc.body)  # an error event inside a stream


async def text_json(client: Client, record: Record):
    import openai

    started = time.monotonic()
    body = chat(client, client.rng.randint(4, 16))
    try:
        answer = await client.openai.chat.completions.create(**body)
    except openai.APIError as exc:
        raise openai_error(exc)
    record.ttft = time.monotonic() - started
    if answer.choices[0].finish_reason not in ("stop", "length"):
        raise Finished("unclear", f"finish_reason {answer.choices[0].finish_reason}")
    return "answered", None


async def text_sse(client: Client, record: Record):
    """Streamed the way the openai package's users read a stream: `chunk.choices[0]`, where
    only a stream that asked for usage may hold a chunk without a choice."""
    import openai

    started = time.monotonic()
    usage = client.rng.random() < 0.5
    body = chat(client, client.rng.randint(4, 16), stream=True,
                **({"stream_options": {"include_usage": True}} if usage else {}))
    reason = None
    try:
        stream = await client.openai.chat.completions.create(**body)
        async for chunk in stream:
            if usage and not chunk.choices:
                continue
            try:
                choice = chunk.choices[0]
            except IndexError:
                raise Finished("unclear", "a chunk without choices in a stream that did not ask for usage")
            if choice.delta.content and record.ttft is None:
                record.ttft = time.monotonic() - started
            reason = choice.finish_reason or reason
    except openai.APIError as exc:
        raise openai_error(exc)
    if reason not in ("stop", "length"):
        raise Finished("unclear", f"stream ended with finish_reason {reason}")
    return "answered", None


def random_png(rng: np.random.Generator) -> str:
    import PIL.Image

    buffer = io.BytesIO()
    PIL.Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def image(client: Client, record: Record):
    rng = client.rng
    fresh = rng.random() < 0.5
    url = random_png(np.random.default_rng(rng.getrandbits(32))) if fresh else rng.choice(client.soak.images)
    body = chat(client, rng.randint(2, 8))
    body["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": "What is in this picture?"}]
    started = time.monotonic()
    status, answer = await post(client, "/v1/chat/completions", body)
    record.ttft = time.monotonic() - started
    return completion_outcome(status, answer)


async def tools(client: Client, record: Record):
    started = time.monotonic()
    status, answer = await post(client, "/v1/chat/completions",
                                chat(client, 96, tools=TOOLS, tool_choice="required"))
    record.ttft = time.monotonic() - started
    return completion_outcome(status, answer)


async def json_schema(client: Client, record: Record):
    started = time.monotonic()
    status, answer = await post(client, "/v1/chat/completions", chat(client, 64, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}))
    record.ttft = time.monotonic() - started
    return completion_outcome(status, answer)


async def spoken_chat(client: Client, record: Record):
    started = time.monotonic()
    status, answer = await post(client, "/v1/chat/completions", chat(
        client, 12, modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"}))
    record.ttft = time.monotonic() - started
    outcome = completion_outcome(status, answer)
    audio = answer["choices"][0]["message"].get("audio") or {}
    if not audio.get("id"):
        raise Finished("unclear", "a spoken answer without an audio id")
    client.soak.spoken_ids[client.tenant].append(audio["id"])
    return outcome


async def vanish(client: Client, record: Record):
    """A streamed chat whose client drops the connection (RST) at its first token."""
    started = time.monotonic()
    reader, writer = await send_request(client, "/v1/chat/completions",
                                        json.dumps(chat(client, 32, stream=True)).encode())
    try:
        status, headers = await read_head(reader)
        if status != 200:
            raise error_outcome(status, parsed(await reader.read()))
        async for event in sse_events(reader, headers):
            if event == "[DONE]":
                return "answered", None  # over before it had a token to leave at
            chunk = json.loads(event)
            if "error" in chunk:
                raise error_outcome(0, chunk)
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                record.ttft = time.monotonic() - started
                abort(writer)
                return "vanished", None
        raise Finished("unclear", "stream ended without [DONE]")
    finally:
        writer.close()


# ---- Realtime --------------------------------------------------------------------------------

def connect(client: Client):
    return websockets.connect(f"ws://127.0.0.1:{client.soak.port}/v1/realtime", max_size=None, compression=None,
                              additional_headers={"Authorization": f"Bearer {client.key}"},
                              local_addr=(client.source, 0), open_timeout=30)


async def send(ws, event: dict) -> None:
    await ws.send(json.dumps(event))


async def until(ws, *types: str) -> dict:
    """The next event of one of `types`; error events end the request."""
    while True:
        event = json.loads(await ws.recv())
        if event["type"] in types:
            return event
        if event["type"] == "error":
            raise error_outcome(0, event)


def audio_chunks(samples: np.ndarray, chunk_s: float = 0.1) -> list[str]:
    from engine.audio_formats import encode_audio

    step = int(chunk_s * RATE)
    return [base64.b64encode(encode_audio(samples[i:i + step], "audio/pcm")).decode()
            for i in range(0, len(samples), step)]


async def speak(ws, samples: np.ndarray, real_time: bool) -> None:
    for chunk in audio_chunks(samples):
        await send(ws, {"type": "input_audio_buffer.append", "audio": chunk})
        if real_time:
            await asyncio.sleep(0.1)


def padded(samples: np.ndarray, before_s: float = 0.3, after_s: float = 0.8) -> np.ndarray:
    return np.concatenate([np.zeros(int(before_s * RATE), np.float32), samples,
                           np.zeros(int(after_s * RATE), np.float32)])


async def voice_turn(client: Client, record: Record):
    """A spoken question, a spoken answer. With server VAD (a third of the turns) the client
    speaks at real-time pace and the server commits; else the client commits. Some answers
    are cut short while they are spoken: by response.cancel, by new speech (VAD), or by a
    client that vanishes."""
    rng = client.rng
    vad = rng.random() < 1 / 3
    draw = rng.random()
    plan = "barge-in" if draw < 0.4 else "vanish" if draw < 0.5 else "complete"
    detection = {"type": "server_vad", "silence_duration_ms": 300} if vad else None
    question = padded(rng.choice(client.soak.speech))
    async with connect(client) as ws:
        await until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {
            "output_modalities": ["audio"], "max_output_tokens": 24 if plan == "complete" else 64,
            "audio": {"input": {"turn_detection": detection}}}})
        await until(ws, "session.updated")
        speaker = asyncio.create_task(speak(ws, question, real_time=vad))
        try:
            if not vad:
                await speaker
                await send(ws, {"type": "input_audio_buffer.commit"})
            await until(ws, "input_audio_buffer.committed")
            started = time.monotonic()
            heard = await until(ws, "conversation.item.input_audio_transcription.completed",
                                "conversation.item.input_audio_transcription.failed")
            if heard["type"].endswith("failed"):
                raise error_outcome(0, heard)
            if not vad:
                await send(ws, {"type": "response.create"})
            response_id = (await until(ws, "response.created"))["response"]["id"]
            while True:
                event = json.loads(await ws.recv())
                kind = event["type"]
                if kind == "error":
                    if event["error"].get("code") == "response_cancel_not_active":
                        continue  # the answer ended before our cancel reached it
                    raise error_outcome(0, event)
                if kind == "response.output_audio.delta" and record.ttft is None:
                    record.ttft = time.monotonic() - started
                    if plan == "vanish":
                        ws.transport.abort()
                        return "vanished", None
                    if plan == "barge-in" and vad:
                        await speaker
                        speaker = asyncio.create_task(speak(ws, padded(rng.choice(client.soak.speech), 0.1, 0.1),
                                                            real_time=True))
                    elif plan == "barge-in":
                        await send(ws, {"type": "response.cancel", "response_id": response_id})
                elif kind == "response.done" and event["response"]["id"] == response_id:
                    status = event["response"]["status"]
                    if status in ("completed", "incomplete", "cancelled"):
                        return "answered", None
                    raise error_outcome(0, (event["response"].get("status_details") or {}).get("error"))
        finally:
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)


# ---- abusive requests ------------------------------------------------------------------------

async def slow_schema(client: Client, record: Record):
    """Ten string properties with distinct maxLength values: seconds of grammar compile each,
    and never the same schema twice, so no compile cache helps."""
    base = client.rng.randrange(10, 10_000)
    schema = {"type": "object", "properties": {f"field{i}": {"type": "string", "maxLength": base + 7 * i}
                                               for i in range(10)},
              "required": [f"field{i}" for i in range(10)]}
    status, answer = await post(client, "/v1/chat/completions", chat(client, 8, response_format={
        "type": "json_schema", "json_schema": {"name": "slow", "schema": schema}}))
    return completion_outcome(status, answer)


async def huge_body(client: Client, record: Record):
    """A 1 MiB prompt: refused, and cheaply, it should be."""
    body = {"model": client.soak.model_name, "messages": [{"role": "user", "content": client.soak.huge_text}],
            "max_tokens": 4}
    status, answer = await post(client, "/v1/chat/completions", body)
    return completion_outcome(status, answer)


async def transcription_flood(client: Client, record: Record):
    boundary = f"soak{client.rng.getrandbits(48):x}"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--{boundary}\r\n"
            f"Content-Disposition: form-data; name=\"file\"; filename=\"long.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
            ).encode() + client.soak.long_wav + f"\r\n--{boundary}--\r\n".encode()
    status, answer = await post(client, "/v1/audio/transcriptions", form, f"multipart/form-data; boundary={boundary}")
    if status != 200:
        raise error_outcome(status, answer)
    return "answered", None


async def id_probe(client: Client, record: Record):
    """The other tenant's spoken-answer id (one its answers really had, as a leak would give
    it) or a guess, sent back as an assistant turn: anything but `audio_expired` is a leak."""
    other = client.soak.spoken_ids["A" if client.tenant == "B" else "B"]
    audio_id = client.rng.choice(other) if other and client.rng.random() < 0.7 else \
        "audio_" + "".join(client.rng.choice("0123456789abcdef") for _ in range(32))
    status, answer = await post(client, "/v1/chat/completions", {
        "model": client.soak.model_name, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Say one word."}, {"role": "assistant", "audio": {"id": audio_id}},
                     {"role": "user", "content": "Repeat your previous message."}]})
    if status == 200:
        raise Finished("leak", f"200 for {'a real' if audio_id in other else 'a guessed'} id of the other tenant")
    await asyncio.sleep(0.2)
    raise error_outcome(status, answer)


async def realtime_flood(client: Client, record: Record):
    """A session that sends audio and commits as fast as it can for a few seconds, reading
    what comes back; one request per session."""
    errors: Counter = Counter()
    examples: dict[str, dict] = {}
    chunks = audio_chunks(padded(client.soak.speech[0]))
    async with connect(client) as ws:
        await until(ws, "session.created")
        await send(ws, {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        await until(ws, "session.updated")

        async def listen() -> None:
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "error" or event["type"].endswith("transcription.failed"):
                    error = event.get("error") or {}
                    errors[error.get("code")] += 1
                    examples[error.get("code")] = error

        listener = asyncio.create_task(listen())
        try:
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline and not listener.done():
                for chunk in chunks:
                    await send(ws, {"type": "input_audio_buffer.append", "audio": chunk})
                await send(ws, {"type": "input_audio_buffer.commit"})
                await asyncio.sleep(0.01)
            await asyncio.sleep(2)  # what the server says about the last of it
            if listener.done():
                listener.result()  # the server closed the session: raises ConnectionClosed
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
    if not errors:
        return "answered", None
    code, _ = errors.most_common(1)[0]
    raise error_outcome(0, examples[code])


HONEST_WORK = {"text-json": text_json, "text-sse": text_sse, "image": image, "tools": tools,
               "json-schema": json_schema, "spoken-chat": spoken_chat, "voice-turn": voice_turn, "vanish": vanish}
ABUSIVE_WORK = {"slow-schema": slow_schema, "1mib-body": huge_body, "transcription-flood": transcription_flood,
                "id-probe": id_probe, "realtime-flood": realtime_flood}


# ---- the clients -----------------------------------------------------------------------------

async def attempt(client: Client, kind: str, work) -> Record:
    soak = client.soak
    record = Record(kind, client.honest, soak.phase, time.monotonic())
    soak.records.append(record)
    try:
        async with asyncio.timeout(soak.args.request_timeout):
            record.outcome, record.code = await work(client, record)
    except Finished as exc:
        record.outcome, record.code = exc.outcome, exc.code
    except TimeoutError:
        record.outcome = "lost"
    except websockets.ConnectionClosed as exc:
        close = exc.rcvd
        # A policy close with its reason is a clear refusal; a keepalive timeout (1011), a
        # normal close mid-request or a dropped connection is not.
        record.outcome = "rejected" if close and close.code in (1008, 1009, 1013) and close.reason else "unclear"
        record.code = f"websocket closed {close.code if close else 'without a close frame'}" + \
            (f" {close.reason}" if close and close.reason else "")
    except (OSError, asyncio.IncompleteReadError, ValueError, KeyError, IndexError, TypeError) as exc:
        record.outcome, record.code = "unclear", f"{type(exc).__name__}: {exc}"[:80]
    record.ended = time.monotonic()
    return record


async def honest_client(soak: Soak, index: int) -> None:
    import httpx2
    import openai

    tenant = "AB"[index % 2]
    source = f"127.0.0.{10 + index}"
    client = Client(soak, source, tenant, True, random.Random(soak.args.seed * 1_000_003 + index))
    client.openai = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{soak.port}/v1", api_key=client.key, max_retries=0,
        timeout=soak.args.request_timeout + 30,
        http_client=httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(local_address=source),
                                       timeout=soak.args.request_timeout + 30))
    kinds, weights = list(HONEST_KINDS), list(HONEST_KINDS.values())
    await asyncio.sleep(client.rng.uniform(0, 3))
    try:
        while not soak.stopping:
            kind = client.rng.choices(kinds, weights)[0]
            await attempt(client, kind, HONEST_WORK[kind])
            await asyncio.sleep(client.rng.uniform(0.2, 1.0))
    finally:
        await client.openai.close()


async def abusive_client(soak: Soak, kind: str, index: int, copy: int) -> None:
    # Tenant B floods voice and probes A's ids; tenant A sends the slow schemas and Realtime floods.
    tenant = "B" if kind in ("1mib-body", "transcription-flood", "id-probe") else "A"
    client = Client(soak, f"127.0.0.{200 + index}", tenant, False,
                    random.Random(soak.args.seed * 7_000_003 + index * 101 + copy))
    while soak.phase == "honest" and not soak.stopping:
        await asyncio.sleep(0.2)
    while not soak.stopping:
        await attempt(client, kind, ABUSIVE_WORK[kind])
        await asyncio.sleep(ABUSE_PAUSE_S)


# ---- the faults ------------------------------------------------------------------------------

async def wait_healthy(soak: Soak, worker: str, old_pid: int | None, timeout: float) -> float | None:
    """When the server is healthy with `worker` served by another process than `old_pid`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = soak.worker_pid(worker)
        if pid is not None and pid != old_pid and await healthy(soak):
            return time.monotonic()
        await asyncio.sleep(0.2)
    return None


async def probe_text(soak: Soak, fault: Fault, done: asyncio.Event) -> None:
    """Plain text chats while the fault lasts: they need only the decoder."""
    client = Client(soak, "127.0.0.250", "A", True, random.Random(len(soak.faults)))
    while not done.is_set():
        record = await attempt(client, "text-probe", probe_chat)
        fault.probes.append(record)
        try:
            await asyncio.wait_for(done.wait(), PROBE_EVERY_S)
        except TimeoutError:
            pass


async def probe_chat(client: Client, record: Record):
    started = time.monotonic()
    status, answer = await post(client, "/v1/chat/completions", chat(client, 4))
    record.ttft = time.monotonic() - started
    return completion_outcome(status, answer)


async def inflict(soak: Soak, worker: str, how: str) -> bool:
    """Once the server is healthy, kills or stops `worker` and probes text until it is
    healthy again; False if it never is."""
    if await wait_healthy(soak, worker, None, FAULT_RECOVERY_S) is None:
        soak.faults.append(Fault(worker, how, time.monotonic(), note="(the server was not healthy before it)"))
        return False
    pid = soak.worker_pid(worker)
    fault = Fault(worker, how, time.monotonic())
    soak.faults.append(fault)
    os.kill(pid, signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP)
    done = asyncio.Event()
    prober = asyncio.create_task(probe_text(soak, fault, done))
    fault.healthy_at = await wait_healthy(soak, worker, pid, FAULT_RECOVERY_S)
    done.set()
    await prober
    if how == "SIGSTOP" and psutil.pid_exists(pid):
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                os.kill(pid, signal.SIGCONT)
                fault.note = "(the stopped process was still there: sent SIGCONT)"
        except psutil.NoSuchProcess:
            pass
    return fault.healthy_at is not None


async def conduct(soak: Soak) -> None:
    total = soak.args.minutes * 60
    soak.phase_times["honest"], soak.phase_times["cpu"] = time.monotonic(), time.process_time()
    await asyncio.sleep(total * PHASE_SHARES["honest"])
    soak.rss["honest"], soak.fds["honest"] = process_rss(soak.server), soak.server.num_fds()
    soak.phase, soak.phase_times["abusive"] = "abusive", time.monotonic()
    await asyncio.sleep(total * PHASE_SHARES["abusive"])
    soak.phase, soak.phase_times["faults"] = "faults", time.monotonic()
    until_at = time.monotonic() + total * PHASE_SHARES["faults"]
    for worker, how in FAULTS:
        await asyncio.sleep(LOAD_BETWEEN_FAULTS_S)
        if not await inflict(soak, worker, how):
            break  # never recovered from: a next fault would measure nothing
    await asyncio.sleep(max(LOAD_BETWEEN_FAULTS_S, until_at - time.monotonic()))
    soak.phase_times["end"] = time.monotonic()
    soak.stopping = True


async def run(soak: Soak) -> None:
    clients = [asyncio.create_task(honest_client(soak, i)) for i in range(soak.args.clients)]
    clients += [asyncio.create_task(abusive_client(soak, kind, index, copy))
                for index, (kind, copies) in enumerate(ABUSIVE_KINDS.items()) for copy in range(copies)]
    await conduct(soak)
    await asyncio.gather(*clients)
    soak.phase_times["drained"] = time.monotonic()


# ---- the report ------------------------------------------------------------------------------

def in_fault_window(record: Record, faults: list[Fault], end: float) -> bool:
    return any(record.started <= to and (record.ended or end) >= since
               for since, to in (fault.window(end) for fault in faults))


def print_table(soak: Soak, end: float) -> list[str]:
    """The per-kind table; returns the must-be-zero counts that are not zero."""
    problems = []
    columns = ("sent", "answered", "vanished", "refused", "rejected", "5xx-fault", "5xx-other", "unclear", "lost")
    print(f"\n  {'kind':<20}" + "".join(f"{c:>10}" for c in columns) +
          f"  {'TTFT p50/p99 ms: honest':>24}  {'+abusive':>12}")
    for honest in (True, False):
        kinds = list(HONEST_KINDS) + ["text-probe"] if honest else list(ABUSIVE_KINDS)
        for kind in kinds:
            chosen = [r for r in soak.records if r.kind == kind and r.honest == honest]
            count = Counter(r.outcome for r in chosen)
            failed = [r for r in chosen if r.outcome == "server_error"]
            inside = sum(in_fault_window(r, soak.faults, end) for r in failed)
            cells = [len(chosen), count["answered"], count["vanished"], count["refused"], count["rejected"],
                     inside, len(failed) - inside, count["unclear"], count["lost"]]
            ttft = []
            for phase in ("honest", "abusive"):
                times = [r.ttft for r in chosen if r.phase == phase and r.ttft is not None
                         and r.outcome in ("answered", "vanished")]
                ttft.append(f"{ms(percentile(times, 0.5))}/{ms(percentile(times, 0.99))}" if honest else "")
            print((f"  {kind:<20}" + "".join(f"{c:>10}" for c in cells) + f"  {ttft[0]:>24}  {ttft[1]:>12}").rstrip())
            for name, value in (("5xx outside a fault window", len(failed) - inside),
                                ("unclear", count["unclear"]), ("lost or hung", count["lost"]),
                                ("leaked", count["leak"])):
                if value:
                    problems.append(f"{kind}: {value} {name}")
    print("\n  codes (kind: outcome code x count):")
    codes = Counter((r.kind, r.outcome, r.code) for r in soak.records if r.code)
    for (kind, outcome, code), n in sorted(codes.items()):
        print(f"    {kind}: {outcome} {code} x {n}")
    return problems


def print_processes(rss: dict[str, dict[str, int]], fds: dict[str, int], frontend_pid: int) -> None:
    """RSS by role at start, after the honest phase and at the end (a restarted worker is
    another pid; a role of several processes, such as the grammar compile server and its
    children, is summed)."""
    def by_role(table: dict[str, int]) -> dict[str, str]:
        roles: dict[str, list] = {}
        for name, value in table.items():
            role, _, pid = name.partition(" (")
            roles.setdefault(role, []).append((pid.rstrip(")") or str(frontend_pid), value))
        return {role: f"{sum(v for _, v in entries) / 2**20:.1f} MiB " +
                (f"(pid {entries[0][0]})" if len(entries) == 1 else f"({len(entries)} processes)")
                for role, entries in roles.items()}

    moments = ("start", "honest", "end")
    tables = [by_role(rss[moment]) for moment in moments]
    print(f"\n  {'RSS':<16}" + "".join(f"{name:>26}" for name in ("start (idle)", "after honest phase", "end (idle)")))
    for role in dict.fromkeys(role for table in tables for role in table):
        print(f"  {role:<16}" + "".join(f"{table.get(role, '-'):>26}" for table in tables))
    print(f"  {'frontend fds':<16}" + "".join(f"{fds[moment]:>26}" for moment in moments))


def report(soak: Soak, idle: dict, after: dict, back: bool, values: dict[str, float], health: int,
           log_name: str) -> bool:
    """Prints the run's results; True if nothing that must be zero is not. `values`: /metrics
    after the load."""
    times = soak.phase_times
    end = times["drained"]
    abusers = ", ".join(f"{kind} x{n}" for kind, n in ABUSIVE_KINDS.items())
    print(f"\nmixed soak: {soak.args.clients} honest clients (tenants A and B, one address each), "
          f"{sum(ABUSIVE_KINDS.values())} abusive ({abusers}); {len(soak.records)} requests")
    print(f"  phases: honest {times['abusive'] - times['honest']:.0f} s, honest + abusive "
          f"{times['faults'] - times['abusive']:.0f} s, faults {times['end'] - times['faults']:.0f} s, "
          f"drain {end - times['end']:.0f} s; total {(end - times['honest']) / 60:.1f} min; "
          f"the clients' own CPU {time.process_time() - times['cpu']:.0f} s")
    problems = print_table(soak, end)
    wrong = [r for r in soak.records if r.outcome in ("unclear", "lost", "leak") or
             (r.outcome == "server_error" and not in_fault_window(r, soak.faults, end))]
    if wrong:
        print("\n  what must not happen (seconds from the start of the load; faults at " +
              ", ".join(f"{f.at - times['honest']:.0f} {f.worker}" for f in soak.faults) + "):")
    for r in wrong[:12]:
        print(f"    {r.started - times['honest']:6.1f}-{(r.ended or end) - times['honest']:6.1f} s  {r.kind} "
              f"({'honest' if r.honest else 'abusive'}, {r.phase}): {r.outcome} {r.code or ''}")

    print("\n  faults (time until /health is 200 with voice ready again; text chats sent while it lasted):")
    for fault in soak.faults:
        recovered = "never" if fault.healthy_at is None else f"{fault.healthy_at - fault.at:.1f} s"
        down = [r for r in fault.probes if fault.healthy_at is None or r.started < fault.healthy_at]
        ok = sum(r.outcome == "answered" for r in down)
        print(f"    {fault.how} {fault.worker:<8} healthy after {recovered:>8}; text probes {ok}/{len(down)} "
              f"answered while down {fault.note}".rstrip())
        if fault.healthy_at is None:
            problems.append(f"{fault.how} {fault.worker}: /health never 200 again")
        if fault.worker in ("encoder", "talker") and (not down or ok < len(down)):
            problems.append(f"text did not flow while the {fault.worker} was down ({ok}/{len(down)})")
    flowed = {worker: all(r.outcome == "answered" for f in soak.faults if f.worker == worker for r in f.probes
                          if f.healthy_at is None or r.started < f.healthy_at)
              for worker in ("encoder", "talker")}
    print(f"  text flowed while the encoder was down: {'yes' if flowed['encoder'] else 'NO'}; "
          f"while the talker was down: {'yes' if flowed['talker'] else 'NO'}")

    print_processes(soak.rss, soak.fds, soak.server.pid)
    print(f"\n  after the load: {after} {'(idle)' if back else '(NOT idle; idle was ' + str(idle) + ')'}")
    voice_after = {name: values.get(name) for name in (
        "antiphon_voice_transcriptions_held", "antiphon_voice_spoken_answers_held", "antiphon_realtime_sessions")}
    print(f"  voice work held: {voice_after}")
    cache = {name: values.get(name) for name in ("antiphon_encoder_cache_items", "antiphon_encoder_cache_usage",
                                                "antiphon_encoder_cache_budget")}
    print(f"  encoder cache: {cache} (a cache, bounded by its budget; not held by requests)")
    planned = Counter(fault.worker for fault in soak.faults if not fault.note.startswith("(the server was not"))
    print("  worker restarts: " + ", ".join(
        f"{worker} {values.get(f'antiphon_{worker}_restarts_total', 0):.0f} ({planned[worker]} by this soak)"
        for worker in ("decoder", "encoder", "talker")))
    print(f"  /health {health}")
    if not back:
        problems.append("KV blocks, slots or request queues not back to idle")
    if any(voice_after.values()):
        problems.append(f"voice work still held: {voice_after}")
    if health != 200:
        problems.append(f"/health {health} after the load")
    log_errors = Counter(line.split(" ERROR ", 1)[1].strip()[:100] for line in Path(log_name).read_text(
        errors="replace").splitlines() if " ERROR " in line)
    print(f"\n  server log ERROR lines ({sum(log_errors.values())}; {log_name}):")
    for line, n in log_errors.most_common(12):
        print(f"    {n} x {line}")
    verdict = "PASS" if not problems else "FAIL: " + "; ".join(problems)
    print(f"\nverdict: {verdict}")
    return not problems


# ---- the run ---------------------------------------------------------------------------------

def prepare(soak: Soak) -> None:
    from engine.audio_formats import write_wav
    from tests.spoken import spoken

    soak.speech = [spoken(question, RATE) for question in QUESTIONS]
    sixteen = np.concatenate([spoken(question, 16000) for question in QUESTIONS])
    soak.long_wav = write_wav(np.resize(sixteen, 30 * 16000), 16000)
    pool = np.random.default_rng(soak.args.seed)
    soak.images = [random_png(pool) for _ in range(6)]
    words = random.Random(soak.args.seed).choices(("river", "stone", "lantern", "garden", "harbor"), k=200_000)
    soak.huge_text = " ".join(words)[:(1 << 20) - 200]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="soak.py --mixed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.5,
                        help="load time, split over the phases (the fault phase runs on until its faults are over)")
    parser.add_argument("--clients", type=int, default=8, help="honest clients (the abusive ones are fixed)")
    parser.add_argument("--model", default=None, help="default: a tiny random Qwen2-VL built into the cache")
    parser.add_argument("--request-timeout", type=float, default=150.0,
                        help="a request with no end by then is lost (over --encoder-timeout's 60 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-arg", action="append", default=[], help="passed to `antiphon serve` (repeatable)")
    parser.add_argument("--records", default=None, help="write every request (kind, phase, times, outcome, code) "
                        "to this file, one JSON object a line")
    args = parser.parse_args(argv)
    args.model = args.model or str(ensure_tiny_vlm())

    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="antiphon-mixed-soak-", suffix=".log", delete=False)
    print(f"server log: {log.name}", flush=True)
    started = time.monotonic()
    process = launch(serve_command(args, port), port, log)
    server = psutil.Process(process.pid)
    workers = server.children(recursive=True)
    print(f"server healthy after {time.monotonic() - started:.0f} s", flush=True)
    try:
        key = KEYS["A"]
        status, models = http_get(port, "/v1/models", {"Authorization": f"Bearer {key}"})
        soak = Soak(args, port, server, json.loads(models)["data"][0]["id"] if status == 200 else "default")
        prepare(soak)
        idle = held_gauges(metrics(port, key))
        soak.rss["start"], soak.fds["start"] = process_rss(server), server.num_fds()
        asyncio.run(run(soak))
        back, after = wait_for_idle(port, idle, key)
        values = metrics(port, key)
        soak.rss["end"], soak.fds["end"] = process_rss(server), server.num_fds()
        health = http_get(port, "/health")[0]
        log.flush()
        if args.records:
            start = soak.phase_times["honest"]
            with open(args.records, "w") as out:
                for r in soak.records:
                    out.write(json.dumps({**asdict(r), "started": r.started - start,
                                          "ended": None if r.ended is None else r.ended - start}) + "\n")
        passed = report(soak, idle, after, back, values, health, log.name)
    finally:
        workers += server.children(recursive=True) if server.is_running() else []
        for worker in workers:  # a stopped worker the server did not get to
            try:
                worker.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        for worker in workers:
            try:
                worker.kill()
            except psutil.NoSuchProcess:
                pass
        log.close()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
