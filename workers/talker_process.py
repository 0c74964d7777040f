"""The talker process: speech synthesis (a Piper voice on onnxruntime), a peer of the decoder.

The frontend sends each spoken answer's text as it is detokenized (SpeakText), the very text
it streams as the answer's transcript, so what is heard is what is shown (stop strings and
all). The talker cuts it into clauses (workers/speech/clause_splitter.py: a short first one,
then sentences), synthesizes each clause as soon as it is complete, resamples it to the rate
the client asked for and sends it to the frontend as one PCM frame on the speech socket.

One clause at a time, round robin over the answers with clauses ready, with the input socket
drained between clauses: a cancel (barge-in, a client gone) takes effect before the next
clause, and one long answer cannot starve the first words of another. Text deltas never wait
for audio: they reach the client from the frontend, which does not wait for the talker.

With an omni model (`omni_speech`) the model speaks for itself: the process runs its talker
and codec instead (workers/omni_talker_worker.py), fed the thinker's rows by the decoder.

Run by the frontend as `python -m workers.talker_process --config JSON --input ADDR
--output ADDR --speech ADDR --thinker-rows ADDR`.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import soxr

from engine import protocol
from engine.audio_formats import to_pcm16
from engine.config import EngineConfig
from workers.ended_answers import EndedAnswers
from workers.worker_loop import WorkerLoop, worker_main

logger = logging.getLogger("antiphon.talker")

# Answers ended here (finished, failed, cancelled) whose text may still be on its way: text
# for them is dropped, not taken for a new answer. Bounded: the oldest are forgotten.
CLOSED_REMEMBERED = 4096
# A clause taking longer than this is a hung synthesis: its beats stop and the watchdog acts.
SYNTHESIS_LIMIT_S = 120.0


@dataclass
class SpokenAnswer:
    sample_rate: int
    speed: float
    splitter: object
    clauses: list[str] = field(default_factory=list)
    text_complete: bool = False
    resampler: object = None
    resampler_flushed: bool = False


class TalkerWorker:
    def __init__(self, config: EngineConfig, addresses: argparse.Namespace) -> None:
        self.config = config
        self.loop = WorkerLoop("talker", addresses.input, addresses.output, protocol.decode_talker_input,
                               handle=self._handle, work=self._speak_next_clause, busy=self._has_clauses)
        self.outputs = self.loop.outputs  # control: ready, heartbeats; where run_worker reports a failure
        self.speech = self.loop.connect_push(addresses.speech)  # audio, to the frontend
        self.voice = None
        # Answers being spoken, in arrival order: the round robin walks it.
        self.answers: OrderedDict[str, SpokenAnswer] = OrderedDict()
        self.closed = EndedAnswers(CLOSED_REMEMBERED)
        # Synthesis runs here, so that the loop's thread can beat while a clause is made.
        self._synthesis = ThreadPoolExecutor(1, thread_name_prefix="synthesis")

    def load(self) -> None:
        from workers.speech.piper_voice import PiperVoice

        started = time.perf_counter()
        self.voice = PiperVoice(self.config.tts_voice, threads=1)
        # First-call initialisation of onnxruntime, and a check of espeak-ng: the voice leaves a
        # clause espeak-ng fails on silent rather than failing the answer, so a broken install
        # must show here, not as answers without sound.
        if not len(self.voice.synthesize("Hello.")):
            raise RuntimeError("the voice says nothing for 'Hello.': is espeak-ng's data installed?")
        logger.info("voice %s loaded and warmed up in %.2f s", self.voice.voice_name, time.perf_counter() - started)
        self.loop.ready()

    def run(self) -> None:
        self.loop.run()

    def _has_clauses(self) -> bool:
        return any(a.clauses for a in self.answers.values())

    def _handle(self, message, frames) -> None:
        """Takes one input; the talker's inputs carry no frames after their header."""
        from workers.speech.clause_splitter import ClauseSplitter

        if isinstance(message, protocol.CancelSpeech):
            for request_id in message.request_ids:
                self.answers.pop(request_id, None)
                self._close(request_id)
            return
        if message.request_id in self.closed:
            return
        answer = self.answers.get(message.request_id)
        if answer is None:
            answer = SpokenAnswer(sample_rate=message.sample_rate, speed=message.speed, splitter=ClauseSplitter())
            self.answers[message.request_id] = answer
        if answer.text_complete:
            return  # text after the final message: the answer is already closed
        answer.clauses += answer.splitter.feed(message.text)
        if message.final:
            answer.clauses += answer.splitter.flush()
            answer.text_complete = True
            if not answer.clauses:
                self._finish(message.request_id)

    def _speak_next_clause(self) -> None:
        request_id = next((r for r, a in self.answers.items() if a.clauses), None)
        if request_id is None:
            return
        answer = self.answers[request_id]
        self.answers.move_to_end(request_id)  # round robin: the others go first next time
        clause = answer.clauses.pop(0)
        try:
            audio = self.loop.beating_while(self._synthesis, SYNTHESIS_LIMIT_S, self.voice.synthesize, clause,
                                            speed=answer.speed)
            pcm = self._to_client_rate(answer, audio)
        except Exception as exc:  # one bad clause fails its answer, never the talker
            logger.exception("synthesis failed for %s", request_id)
            self.answers.pop(request_id, None)
            self._close(request_id)
            self._send(protocol.SpeechAudio(request_id=request_id, sample_rate=answer.sample_rate, final=True,
                                            error=f"speech synthesis failed: {exc}"))
            return
        self._send(protocol.SpeechAudio(request_id=request_id, sample_rate=answer.sample_rate, text=clause), pcm)
        if answer.text_complete and not answer.clauses:
            self._finish(request_id)

    def _to_client_rate(self, answer: SpokenAnswer, audio: np.ndarray) -> bytes:
        if answer.sample_rate != self.voice.sample_rate:
            # One stream per answer: its filter state carries over clause boundaries.
            if answer.resampler is None:
                answer.resampler = soxr.ResampleStream(self.voice.sample_rate, answer.sample_rate, 1,
                                                       dtype="float32")
            last = answer.text_complete and not answer.clauses
            audio = answer.resampler.resample_chunk(audio.astype(np.float32), last=last)
            answer.resampler_flushed = last
        return to_pcm16(audio).astype("<i2").tobytes()

    def _finish(self, request_id: str) -> None:
        answer = self.answers.pop(request_id)
        self._close(request_id)
        tail = b""
        if answer.resampler is not None and not answer.resampler_flushed:
            # The text ended after the last clause was resampled: the filter's tail is left.
            tail = to_pcm16(answer.resampler.resample_chunk(np.zeros(0, np.float32), last=True)).tobytes()
        self._send(protocol.SpeechAudio(request_id=request_id, sample_rate=answer.sample_rate, final=True), tail)

    def _close(self, request_id: str) -> None:
        self.closed.add(request_id)

    def _send(self, message: protocol.SpeechAudio, pcm: bytes | None = None) -> None:
        header = protocol.encode(message)
        if pcm:
            self.speech.send_multipart([header, pcm], copy=False)
        else:
            self.speech.send(header)

    def close(self) -> None:
        self._synthesis.shutdown(wait=False, cancel_futures=True)
        self.loop.close()


def make_talker(config: EngineConfig, addresses: argparse.Namespace):
    if config.omni_speech:
        from workers.omni_talker_worker import OmniTalkerWorker

        return OmniTalkerWorker(config, addresses)
    return TalkerWorker(config, addresses)


def main() -> None:
    worker_main("talker", make_talker)


if __name__ == "__main__":
    main()
