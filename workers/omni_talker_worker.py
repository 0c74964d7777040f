"""The talker process of an omni model: the model's own talker and codec speak its answers.

With an omni model and voice on, the talker process runs this worker instead of a Piper voice.
The decoder announces each spoken answer (StartSpeaking) and sends the thinker's rows as it
makes them (ThinkerRows, one raw frame each); the talker stage (engine/talker_stage.py) runs
the talker as an engine core of its own, batching every answer being spoken, and the codec
turns each answer's codes into audio as they come (a small first chunk, then steady chunks
with their context: Qwen2.5-Omni's CodecStream, Qwen3-Omni's Code2WavStream), sent to the frontend as 16-bit PCM
at the rate the client asked for (SpeechAudio, on the speech socket). The frontend's CancelSpeech (barge-in,
a client gone) drops an answer wherever it is: rows still on their way are ignored.

One talker step per loop turn; between steps the loop takes every message that arrived, so a
cancel takes effect before the next step. A talker that waits only for rows sleeps on its
sockets instead of spinning.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from engine import protocol
from engine.array_frames import tensor_from_frame
from engine.audio_formats import to_pcm16
from engine.config import EngineConfig
from engine.cpu_cores import usable_cores
from engine.thinker_rows import TalkerPrompt
from workers.ended_answers import EndedAnswers
from workers.worker_loop import WorkerLoop

logger = logging.getLogger("antiphon.talker")

# One chunk's decode taking longer than this is a hung codec: its beats stop and the watchdog acts.
CODEC_LIMIT_S = 60.0


@dataclass
class Listener:
    """Where an answer's audio goes: its id at the frontend and the client's sample rate."""

    speech_id: str
    sample_rate: int
    resampler: object = None
    codec: object = None  # its CodecStream, from its first codes on


def talker_threads(config: EngineConfig) -> int:
    """The talker's threads on a CPU: its flag, else a quarter of the cores this process may
    use, at least one (the decoder's steps want the cores too)."""
    if config.talker_threads is not None:
        return config.talker_threads
    return max(1, usable_cores() // 4)


class OmniTalkerWorker:
    def __init__(self, config: EngineConfig, addresses: argparse.Namespace) -> None:
        self.config = config
        self.loop = WorkerLoop("talker", addresses.input, addresses.output, protocol.decode_talker_input,
                               handle=self._handle, work=self._step, busy=self._can_step)
        self.outputs = self.loop.outputs
        # Unbounded: the decoder never drops rows for a live talker (workers/thinker_rows_sender.py).
        self.loop.bind_pull(addresses.thinker_rows, self._take_rows, unbounded=True)
        self.speech = self.loop.connect_push(addresses.speech)
        self.stage = None
        self.listeners: dict[str, Listener] = {}
        self.closed = EndedAnswers()  # rows still on their way for these are dropped
        self._codec = ThreadPoolExecutor(1, thread_name_prefix="codec")

    def load(self) -> None:
        import torch
        from transformers import AutoConfig

        from engine.adapters import talker_spec
        from engine.checkpoint import resolve_model_path
        from engine.talker_stage import TalkerStage
        from workers.model_loader import resolve_device, resolve_dtype

        started = time.perf_counter()
        path = resolve_model_path(self.config.model)
        device = resolve_device(self.config.device)
        if device.type == "cpu":
            torch.set_num_threads(talker_threads(self.config))
        dtype = resolve_dtype(self.config.dtype, AutoConfig.from_pretrained(path), device)
        spec = talker_spec(path)
        # Its own pool, sized by the default rule for its (small) blocks; no prefix caching:
        # its prompt's codes are the same whatever was said.
        talker_config = dataclasses.replace(
            self.config, enable_prefix_caching=False, async_scheduling=False, encoder_cache_size=0,
            num_kv_blocks=None, kv_cache_memory_gib=None, max_model_len=None, omni_speech=False)
        self.stage = TalkerStage(spec, talker_config, device, dtype, rows_dtype=dtype)
        logger.info("talker and codec of %s loaded in %.2f s on %d CPU thread(s); voices %s", path.name,
                    time.perf_counter() - started, torch.get_num_threads(), ", ".join(sorted(spec.speakers)))
        self.loop.ready(voices=sorted(spec.speakers))

    def run(self) -> None:
        self.loop.run()

    def close(self) -> None:
        self._codec.shutdown(wait=False, cancel_futures=True)
        self.loop.close()

    # ---- inputs ---------------------------------------------------------------------------

    def _handle(self, message, frames) -> None:
        """The frontend's inputs (and the decoder's, which arrive on their own socket)."""
        if isinstance(message, protocol.CancelSpeech):
            for speech_id in message.request_ids:
                self.stage.drop(speech_id)
                self.listeners.pop(speech_id, None)
                self._close(speech_id)
        elif isinstance(message, protocol.StartSpeaking):
            self._start(message, frames)
        elif isinstance(message, protocol.ThinkerRows):
            self._rows(message, frames)
        # SpeakText: an omni model speaks its own thinker's rows, not text it is sent.

    def _take_rows(self, frames) -> None:
        try:
            message = protocol.decode_talker_input(frames[0].bytes)
        except Exception as exc:  # noqa: BLE001 - a bad message is skipped, never fatal
            logger.error("skipped an undecodable message from the decoder: %s", exc)
            return
        self._handle(message, frames[1:])

    def _start(self, message: protocol.StartSpeaking, frames) -> None:
        speech = message.speech
        if speech.speech_id in self.closed or speech.speech_id in self.listeners:
            return
        try:
            positions = None
            if message.has_positions:
                if not frames:
                    raise ValueError("the talker prompt's positions are missing")
                positions = np.frombuffer(frames[0], dtype=np.int64).reshape(3, -1).copy()
            prompt = TalkerPrompt(cut=message.cut, kept=[tuple(r) for r in message.kept],
                                  items=[tuple(r) for r in message.items], mrope_positions=positions,
                                  mrope_delta=message.mrope_delta)
            params = self.stage.default_params(self.config.max_spoken_codes, speech.seed)
            self.stage.check(speech.voice, prompt, params)
            self.stage.add(speech.speech_id, prompt, speech.voice, params)
        except (ValueError, IndexError) as exc:
            self._fail(Listener(speech.speech_id, speech.sample_rate), f"the answer cannot be spoken: {exc}")
            return
        self.listeners[speech.speech_id] = Listener(speech.speech_id, speech.sample_rate)

    def _rows(self, message: protocol.ThinkerRows, frames) -> None:
        listener = self.listeners.get(message.speech_id)
        if listener is None:
            return  # cancelled, failed, or announced to a talker that has since restarted
        try:
            rows = tensor_from_frame(message, frames[0]) if message.shape else None
            if rows is not None and rows.ndim != 2:
                raise ValueError(f"rows of shape {list(rows.shape)}")
            dropped = self.stage.receive(message.speech_id, message.start, rows, message.ended, message.error)
        except (ValueError, RuntimeError, IndexError) as exc:
            self.stage.drop(message.speech_id)
            self._fail(listener, f"the thinker's rows do not fit: {exc}")
            return
        if dropped is not None and dropped.error is not None:  # its text failed
            self._fail(listener, dropped.error)
        elif dropped is not None:  # its text ended before its first word: nothing to say
            self._send(listener, b"", final=True)

    # ---- work -----------------------------------------------------------------------------

    def _can_step(self) -> bool:
        """Whether a step would do something: not while every answer waits for rows."""
        talker = self.stage.talker
        return talker.has_unfinished_requests and not talker.last_step_was_empty

    def _step(self) -> None:
        talker = self.stage.talker
        if not talker.has_unfinished_requests:
            return
        for update in self.stage.step():
            listener = self.listeners.get(update.answer.request_id)
            if listener is None:
                continue
            answer = update.answer
            if answer.error is not None:
                self._fail(listener, f"the talker failed: {answer.error}")
                continue
            try:
                chunks = self.loop.beating_while(self._codec, CODEC_LIMIT_S, self._decode, listener, answer,
                                                 update.new_codes, update.finished)
            except Exception as exc:  # noqa: BLE001 - one answer's codec failure fails that answer only
                logger.exception("the codec failed for %s", listener.speech_id)
                self._fail(listener, f"the codec failed: {exc}")
                continue
            for index, chunk in enumerate(chunks):
                last = update.finished and index == len(chunks) - 1
                if not chunk.numel() and not last:
                    continue
                # The last one, even empty, flushes the resampler's tail.
                pcm = self._pcm(listener, chunk.numpy(), last)
                if pcm:
                    self._send(listener, pcm)
            if update.finished:
                self._send(listener, b"", final=True)
            # Many answers' chunks in one turn: the frontend must still hear this loop.
            self.loop.beat_if_due()

    def _decode(self, listener: Listener, answer, new_codes: list, finished: bool) -> list:
        """The waveform chunks the answer's new codes complete (the rest too once it is finished)."""
        if listener.codec is None:
            if not new_codes and finished:
                return []
            listener.codec = self.stage.codec_stream(answer)
        chunks = listener.codec.feed(new_codes) if new_codes else []
        if finished:
            chunks.append(listener.codec.finish())
        return chunks

    def _pcm(self, listener: Listener, audio: np.ndarray, last: bool) -> bytes:
        rate = self.stage.spec.sample_rate
        if listener.sample_rate != rate:
            import soxr

            # One stream per answer: its filter state carries over chunk boundaries.
            if listener.resampler is None:
                listener.resampler = soxr.ResampleStream(rate, listener.sample_rate, 1, dtype="float32")
            audio = listener.resampler.resample_chunk(audio.astype(np.float32), last=last)
        return to_pcm16(audio).astype("<i2").tobytes()

    # ---- outputs --------------------------------------------------------------------------

    def _send(self, listener: Listener, pcm: bytes, final: bool = False, error: str | None = None) -> None:
        header = protocol.encode(protocol.SpeechAudio(request_id=listener.speech_id, sample_rate=listener.sample_rate,
                                                      final=final, error=error))
        if pcm:
            self.speech.send_multipart([header, pcm], copy=False)
        else:
            self.speech.send(header)
        if final:
            self.listeners.pop(listener.speech_id, None)
            self._close(listener.speech_id)

    def _fail(self, listener: Listener, reason: str) -> None:
        logger.warning("answer %s not spoken: %s", listener.speech_id, reason)
        self.stage.drop(listener.speech_id)  # talker request, KV and rows: nobody listens any more
        self._send(listener, b"", final=True, error=reason)

    def _close(self, speech_id: str) -> None:
        self.closed.add(speech_id)
