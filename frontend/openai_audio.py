"""OpenAI's audio endpoints: POST /v1/audio/transcriptions and POST /v1/audio/speech.

Transcriptions take a multipart upload (a WAV file; this server decodes no compressed
formats) and answer `json`, `text` or `verbose_json`, or stream `transcript.text.delta` /
`.done` events with `stream=true`. The encoder process recognizes the audio, in windows of
at most 30 s cut at pauses. Speech streams the talker's audio as it is made: raw 16-bit PCM
at 24 kHz (`pcm`), a WAV whose header announces an open length (`wav`), or
`speech.audio.delta` events (`stream_format=sse`). Every field OpenAI defines is either
honoured or refused with a 400 naming it; so is any other field.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from engine.audio_formats import read_wav, resample, wav_header
from engine.audio_windows import RECOGNIZER_RATE
from frontend.chat_audio import SPEECH_RATE
from frontend.engine_errors import EngineUnavailable, VoiceBusy
from frontend.limits import requester_of_request
from frontend.speech_recognition import recognized_segments
from frontend.tenancy import Requester
from frontend.openai_http import body_or_error, error_response
from frontend.request_lifecycle import LeasedStreamingResponse
from workers.speech.speakable import has_words

logger = logging.getLogger("antiphon.frontend")

TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json")
SPEECH_FORMATS = {"pcm": "audio/pcm", "wav": "audio/wav"}
TRANSCRIPTION_FIELDS = {"file", "model", "response_format", "language", "temperature", "stream", "prompt"}
SPEECH_FIELDS = {"model", "input", "voice", "response_format", "speed", "stream_format", "instructions"}


class SpeechFailed(RuntimeError):
    """The talker failed mid-answer."""


class AudioRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class AudioEndpoints:
    def __init__(self, app_state) -> None:
        self.state = app_state
        self._ids = itertools.count()

    # ---- transcriptions ----------------------------------------------------------------

    async def transcriptions(self, request: Request) -> Response:
        config = self.state.config
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            return error_response(400, "send the audio as multipart/form-data with a `file` part", "invalid_request")
        # The form's other fields need a little room beside the audio itself.
        body = await body_or_error(request, config, config.max_audio_bytes + (64 << 10))
        if isinstance(body, Response):
            return body
        try:
            form = await self._form(request, body)
            options = self._transcription_options(form)
            samples = await asyncio.to_thread(self._decode_upload, form, config.max_audio_seconds)
        except AudioRequestError as exc:
            return error_response(exc.status, str(exc), exc.code, exc.param)
        duration = len(samples) / RECOGNIZER_RATE
        requester = requester_of_request(config, request)
        if options["stream"]:
            return StreamingResponse(self._stream_transcript(samples, duration, requester),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            segments = [segment async for segment in recognized_segments(self.state.client, samples, requester)]
        except VoiceBusy as exc:
            return error_response(429, str(exc), "voice_busy", error_type="rate_limit_error",
                                  headers={"Retry-After": "1"})
        except EngineUnavailable as exc:
            return error_response(503, str(exc), "engine_unavailable", error_type="server_error")
        text = " ".join(s["text"] for s in segments if s["text"]).strip()
        if options["response_format"] == "text":
            return PlainTextResponse(text + "\n")
        usage = {"type": "duration", "seconds": round(duration, 3)}
        if options["response_format"] == "json":
            return JSONResponse({"text": text, "usage": usage})
        return JSONResponse({"task": "transcribe", "language": "english", "duration": round(duration, 3),
                             "text": text, "segments": segments, "usage": usage})

    @staticmethod
    async def _form(request: Request, body: bytes):
        async def replay():
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            return await Request(request.scope, replay).form(max_files=1, max_fields=16)
        except Exception as exc:  # the multipart parser's own errors: a malformed upload
            raise AudioRequestError(f"malformed multipart body: {exc}", code="invalid_request") from None

    @staticmethod
    def _transcription_options(form) -> dict:
        unknown = sorted(set(form.keys()) - TRANSCRIPTION_FIELDS)
        if unknown:
            raise AudioRequestError(f"unsupported parameter {unknown[0]!r}", unknown[0], "unsupported_parameter")
        response_format = form.get("response_format", "json")
        if response_format not in TRANSCRIPTION_FORMATS:
            raise AudioRequestError(f"response_format must be one of {', '.join(TRANSCRIPTION_FORMATS)} "
                                    "(this server writes no subtitles)", "response_format")
        language = form.get("language")
        if language not in (None, "", "en"):
            raise AudioRequestError("the speech recognizer knows English only: language must be 'en'", "language")
        if form.get("prompt"):
            raise AudioRequestError("prompting the recognizer is not supported: leave prompt empty", "prompt",
                                    "unsupported_parameter")
        try:
            temperature = float(form.get("temperature", 0) or 0)
        except ValueError:
            raise AudioRequestError("temperature must be a number", "temperature") from None
        if temperature != 0:
            raise AudioRequestError("the recognizer decodes greedily: temperature must be 0", "temperature",
                                    "unsupported_parameter")
        stream = str(form.get("stream", "false")).lower()
        if stream not in ("true", "false"):
            raise AudioRequestError("stream must be true or false", "stream")
        if stream == "true" and response_format != "json":
            raise AudioRequestError("streamed transcripts are events: response_format must be json", "response_format")
        return {"response_format": response_format, "stream": stream == "true"}

    @staticmethod
    def _decode_upload(form, max_seconds: float) -> np.ndarray:
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise AudioRequestError("the audio goes in a file part named `file`", "file")
        data = upload.file.read()
        try:
            samples, rate = read_wav(data)
        except ValueError as exc:
            raise AudioRequestError(f"file: {exc} (this server reads WAV: 8, 16 or 32-bit PCM)", "file",
                                    "invalid_audio") from None
        if len(samples) > max_seconds * rate:
            raise AudioRequestError(f"audio of {len(samples) / rate:.1f} s is over the limit of {max_seconds:g} s "
                                    "(--max-audio-seconds)", "file", "audio_too_long")
        return resample(samples, rate, RECOGNIZER_RATE)

    async def _stream_transcript(self, samples, duration: float, requester: Requester):
        texts = []
        try:
            async for segment in recognized_segments(self.state.client, samples, requester):
                if segment["text"]:
                    delta = (" " if texts else "") + segment["text"]
                    texts.append(segment["text"])
                    yield _event({"type": "transcript.text.delta", "delta": delta})
        except EngineUnavailable as exc:
            code = "voice_busy" if isinstance(exc, VoiceBusy) else "engine_unavailable"
            yield _event({"type": "error", "error": {"message": str(exc), "code": code}})
            return
        yield _event({"type": "transcript.text.done", "text": " ".join(texts),
                      "usage": {"type": "duration", "seconds": round(duration, 3)}})

    # ---- speech ------------------------------------------------------------------------

    async def speech(self, request: Request) -> Response:
        config = self.state.config
        body = await body_or_error(request, config)
        if isinstance(body, Response):
            return body
        try:
            options = self._speech_options(body, config.max_speech_input_chars)
        except AudioRequestError as exc:
            return error_response(exc.status, str(exc), exc.code, exc.param)
        client = self.state.client
        if client.speaks_itself:
            # Its talker speaks what its thinker says (it is fed the thinker's hidden states), not
            # arbitrary text: reading a text aloud word for word is the cascade's job.
            return error_response(400, "this server's omni model speaks its own answers only; /v1/audio/speech "
                                  "needs a text model with the Piper voice", "unsupported_model", "model")
        request_id = f"speech-{next(self._ids)}"
        try:
            queue = client.open_speech(request_id, requester_of_request(config, request))
            await client.speak(request_id, options["input"], final=True, sample_rate=SPEECH_RATE,
                               speed=options["speed"])
            # Wait for the first piece before answering: a failure then is still a clean 503.
            first = await queue.get()
        except VoiceBusy as exc:
            client.cancel_speech(request_id)
            return error_response(429, str(exc), "voice_busy", error_type="rate_limit_error",
                                  headers={"Retry-After": "1"})
        except EngineUnavailable as exc:
            client.cancel_speech(request_id)
            return error_response(503, str(exc), "voice_unavailable", error_type="server_error")
        except BaseException:
            client.cancel_speech(request_id)
            raise
        if first[0].error is not None:
            return error_response(503, first[0].error, "voice_unavailable", error_type="server_error")
        pieces = self._pieces(request_id, queue, first)
        # The talker stops however the response ends, also when the client leaves before its
        # body starts (then _pieces' own cleanup never runs).
        stop = lambda: client.cancel_speech(request_id)  # noqa: E731
        if options["stream_format"] == "sse":
            return LeasedStreamingResponse(stop, self._speech_events(pieces), media_type="text/event-stream",
                                           headers={"Cache-Control": "no-cache"})
        body_iter = self._wav_stream(pieces) if options["response_format"] == "wav" else pieces
        return LeasedStreamingResponse(stop, body_iter, media_type=SPEECH_FORMATS[options["response_format"]],
                                       headers={"X-Sample-Rate": str(SPEECH_RATE)})

    @staticmethod
    def _speech_options(body: bytes, max_chars: int) -> dict:
        try:
            fields = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise AudioRequestError("the body is not JSON", code="invalid_json") from None
        if not isinstance(fields, dict):
            raise AudioRequestError("the body must be a JSON object", code="invalid_json")
        unknown = sorted(set(fields) - SPEECH_FIELDS)
        if unknown:
            raise AudioRequestError(f"unsupported parameter {unknown[0]!r}", unknown[0], "unsupported_parameter")
        text = fields.get("input")
        if not isinstance(text, str) or not text:
            raise AudioRequestError("input must be a non-empty string", "input")
        if len(text) > max_chars:
            raise AudioRequestError(f"input of {len(text)} characters is over the limit of {max_chars} "
                                    "(--max-speech-input-chars)", "input", "string_above_max_length")
        if not has_words(text):
            raise AudioRequestError("input has nothing to speak: it needs a letter or a digit (emoji, "
                                    "punctuation and whitespace are silent)", "input", "nothing_to_speak")
        for name in ("model", "voice"):
            if name in fields and not isinstance(fields[name], str):
                raise AudioRequestError(f"{name} must be a string", name)
        response_format = fields.get("response_format", "pcm")
        if response_format not in SPEECH_FORMATS:
            raise AudioRequestError(f"response_format must be one of {', '.join(SPEECH_FORMATS)} "
                                    "(this server encodes no compressed audio)", "response_format")
        speed = fields.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
            raise AudioRequestError("speed must be a number from 0.25 to 4.0", "speed")
        if fields.get("instructions"):
            raise AudioRequestError("this voice takes no instructions", "instructions", "unsupported_parameter")
        stream_format = fields.get("stream_format", "audio")
        if stream_format not in ("audio", "sse"):
            raise AudioRequestError("stream_format must be audio or sse", "stream_format")
        return {"input": text, "response_format": response_format, "speed": float(speed),
                "stream_format": stream_format}

    async def _pieces(self, request_id: str, queue: asyncio.Queue, first):
        """The answer's (header, pcm) pieces; stops the talker if the client goes away."""
        client = self.state.client
        piece = first
        try:
            while True:
                header, pcm = piece
                if header.error is not None:
                    # Headers are sent: aborting the body is how the client learns the audio
                    # is incomplete (an SSE stream gets an error event first).
                    raise SpeechFailed(header.error)
                if pcm:
                    yield pcm
                if header.final:
                    return
                piece = await queue.get()
        finally:
            client.cancel_speech(request_id)  # a no-op once the talker said final

    @staticmethod
    async def _wav_stream(pieces):
        yield wav_header(SPEECH_RATE)
        async for pcm in pieces:
            yield pcm

    @staticmethod
    async def _speech_events(pieces):
        try:
            async for pcm in pieces:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode()})
        except SpeechFailed as exc:
            yield _event({"type": "error", "error": {"message": str(exc), "code": "voice_unavailable"}})
            return
        yield _event({"type": "speech.audio.done"})


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
