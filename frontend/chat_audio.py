"""Voice in chat completions: `input_audio` parts become their transcripts before the chat
template sees them (or, for a model that hears audio itself, audio items for its encoder), and with `modalities: ["text", "audio"]` the answer is spoken by the
talker (its text goes to the talker as it is generated; the audio comes back as it is made).
"""

from __future__ import annotations

import asyncio
import base64
import binascii

from engine.audio_formats import read_wav, resample, sample_rate_of, wav_header
from engine.audio_windows import RECOGNIZER_RATE
from frontend.edge_decoding import InvalidInput
from frontend.speech_recognition import transcribe
from frontend.spoken_answers import SpokenAnswerStore
from frontend.tenancy import ANONYMOUS, Requester

# Spoken answers come as OpenAI's pcm16: 24 kHz.
SPEECH_RATE = sample_rate_of("audio/pcm")


async def prepare_audio_parts(client, messages: list[dict], hears: bool, voice_on: bool, max_seconds: float,
                              requester: Requester = ANONYMOUS) -> None:
    """Replaces every input_audio part of `messages`: for a model that hears audio itself (an
    omni model, `hears`) by an audio part holding its samples and rate, for the model's encoder;
    otherwise by a text part holding its transcript (voice on)."""
    for message in messages:
        content = message["content"]
        if not isinstance(content, list):
            continue
        for index, part in enumerate(content):
            if part["type"] != "input_audio":
                continue
            if not hears and not voice_on:
                raise InvalidInput("voice is off on this server (--no-voice)", "unsupported_modality",
                                   "messages.content")
            samples, rate = await asyncio.to_thread(_read_wav_part, part["input_audio"], max_seconds)
            if hears:
                content[index] = {"type": "audio", "audio": (samples, rate)}
                continue
            text, heard = await transcribe(client, await asyncio.to_thread(resample, samples, rate, RECOGNIZER_RATE),
                                           requester)
            if not heard:
                raise InvalidInput("no speech was heard in an input_audio part", "input_audio_no_speech",
                                   "messages.content")
            content[index] = {"type": "text", "text": text}


def _read_wav_part(audio: dict, max_seconds: float) -> tuple:
    """An input_audio part's (float32 mono samples, rate)."""
    if audio["format"] != "wav":
        raise InvalidInput("this server reads input_audio in wav format only", "invalid_value", "messages.content")
    try:
        samples, rate = read_wav(base64.b64decode(audio["data"], validate=True))
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"input_audio is not a readable base64 WAV: {exc}", "invalid_audio",
                           "messages.content") from None
    if len(samples) > max_seconds * rate:
        raise InvalidInput(f"input_audio of {len(samples) / rate:.1f} s is over the limit of {max_seconds:g} s",
                           "audio_too_long", "messages.content")
    return samples, rate


class SpokenAnswer:
    """One chat answer spoken by the talker: `say` its text as it comes, `ready` / `rest` its
    audio as 16-bit PCM at 24 kHz, `close` when done (stops the talker if it is not). Once
    the talker has spoken all of it, its transcript is remembered under its id for its tenant."""

    def __init__(self, client, request_id: str, audio_format: str, store: SpokenAnswerStore,
                 requester: Requester) -> None:
        self.client = client
        self.request_id = request_id
        self.audio_format = audio_format
        self.id = store.new_id()
        self.expires_at = store.expires_at()
        self._store = store
        self._tenant = requester.tenant
        self._said: list[str] = []
        self.queue = client.open_speech(request_id, requester)  # raises EngineUnavailable / VoiceBusy
        self.ended = False

    async def say(self, text: str, final: bool = False) -> None:
        self._said.append(text)
        await self.client.speak(self.request_id, text, final=final, sample_rate=SPEECH_RATE)

    def ready(self) -> list[bytes]:
        """The audio made so far and not yet taken."""
        pieces = []
        while not self.ended and not self.queue.empty():
            pieces += self._take(self.queue.get_nowait())
        return pieces

    async def next_pieces(self) -> list[bytes]:
        """Waits for the next piece (an empty list when it carried no audio)."""
        return self._take(await self.queue.get()) if not self.ended else []

    async def rest(self) -> list[bytes]:
        """Every remaining piece, once the talker has spoken the whole answer."""
        pieces = self.ready()
        while not self.ended:
            pieces += self._take(await self.queue.get())
        return pieces

    def _take(self, piece) -> list[bytes]:
        header, pcm = piece
        if header.error is not None:
            self.ended = True
            raise SpeechFailed(header.error)
        self.ended = header.final
        if header.final:
            self._store.remember(self._tenant, self.id, "".join(self._said), self.expires_at)
        return [pcm] if pcm else []

    def message_audio(self, pcm: bytes, transcript: str) -> dict:
        data = wav_header(SPEECH_RATE, len(pcm)) + pcm if self.audio_format == "wav" else pcm
        return {"id": self.id, "data": base64.b64encode(data).decode(), "expires_at": self.expires_at,
                "transcript": transcript}

    def close(self) -> None:
        self.client.cancel_speech(self.request_id)


class SpeechFailed(RuntimeError):
    """The talker failed while speaking the answer."""
