"""The front end's one handle on the engine: EngineClient, over a supervisor and one client per
actor.

- WorkerSupervisor (worker_supervisor.py): the workers' processes, sockets, heartbeats,
  restarts within a restart budget, shutdown; it reads every worker output and hands it to
  `_route` here.
- DecoderClient (decoder_client.py): each request's queue of deltas; releases and aborts,
  batched with the encoder's releases by EndedRequests (ended_requests.py).
- EncoderClient (encoder_client.py): requests' image items, the encoder cache's mirror, clips
  to transcribe.
- TalkerClient (talker_client.py): spoken answers, when voice is on.

When the supervisor loses a worker, `_worker_lost` here fails what needed it: every request in
flight for the decoder, those with items and every clip for the encoder, the answers being
spoken for the talker. When it fails for good, everything in flight fails.
"""

from __future__ import annotations

import asyncio

from engine import protocol
from engine.config import EngineConfig
from frontend.decoder_client import DecoderClient
from frontend.encoder_client import EncoderClient
from frontend.ended_requests import EndedRequests
from frontend.talker_client import TalkerClient
from frontend.tenancy import ANONYMOUS, FairShare, Requester, share_of
from frontend.worker_supervisor import WorkerSupervisor


def fair_shares(max_transcriptions: int, max_spoken_answers: int, share_per_tenant: float,
                share_per_client: float) -> tuple[FairShare, FairShare]:
    """The voice work the server takes at once: past these, voice work is refused (429) rather
    than queued behind a flood, and no tenant or client may hold them all."""
    return (FairShare("clips being recognized", "--max-transcriptions", max_transcriptions,
                      share_of(max_transcriptions, share_per_tenant), share_of(max_transcriptions, share_per_client)),
            FairShare("answers being spoken", "--max-spoken-answers", max_spoken_answers,
                      share_of(max_spoken_answers, share_per_tenant), share_of(max_spoken_answers, share_per_client)))


class EngineClient:
    def __init__(self, config: EngineConfig, *, max_restarts: int = 3, restart_window_s: float = 600.0,
                 worker_timeout_s: float = 30.0, on_fatal=None, max_transcriptions: int = 16,
                 max_spoken_answers: int = 16, share_per_tenant: float = 1.0, share_per_client: float = 1.0,
                 shares: tuple[FairShare, FairShare] | None = None, on_cache_changes=None, on_lost=None,
                 launcher=None) -> None:
        """A data-parallel replica (frontend/replica_set.py) is one EngineClient: `shares` are the
        server's (transcriptions, spoken answers) shared by every replica; `on_cache_changes(message)`
        hears its decoder's PrefixCacheChanges and its encoder's CacheChanges; `on_lost(worker,
        reason)` hears each lost worker; `launcher` starts its processes (frontend/launchers.py)."""
        self.supervisor = WorkerSupervisor(config, max_restarts=max_restarts, restart_window_s=restart_window_s,
                                           worker_timeout_s=worker_timeout_s, on_fatal=on_fatal, route=self._route,
                                           on_lost=self._worker_lost, on_failed=self._fail_in_flight,
                                           launcher=launcher)
        self.config = config
        self.on_cache_changes = on_cache_changes
        self.on_lost = on_lost
        if shares is None:
            shares = fair_shares(max_transcriptions, max_spoken_answers, share_per_tenant, share_per_client)
        self.transcriptions, self.spoken_answers = shares
        self.ended = EndedRequests(self.supervisor)
        self.encoder = EncoderClient(self.supervisor, self.ended, self.transcriptions)
        self.decoder = DecoderClient(self.supervisor, self.ended, self.encoder)
        self.talker = TalkerClient(self.supervisor, self.spoken_answers)

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        background = [("abort-sender", self.ended.send())]
        if self.supervisor.from_talker is not None:
            background.append(("speech-reader", self.talker.read_speech()))
        await self.supervisor.start(background)

    async def shutdown(self) -> None:
        await self.supervisor.shutdown()

    @property
    def status(self) -> str:
        return self.supervisor.status

    @property
    def healthy(self) -> bool:
        return self.supervisor.healthy

    @property
    def serves_text(self) -> bool:
        return self.supervisor.serves_text

    @property
    def ready(self) -> dict[str, protocol.WorkerReady]:
        return self.supervisor.ready

    @property
    def restarts(self) -> dict[str, int]:
        return self.supervisor.restarts

    # ---- requests (the decoder) --------------------------------------------------------

    async def add_request(self, request: protocol.EngineRequest, on_finished=None, items=(),
                          conversation: str | None = None) -> asyncio.Queue:
        """See DecoderClient.add_request (`conversation` matters only to a replica set's router)."""
        return await self.decoder.add_request(request, on_finished, items)

    def release(self, request_id: str) -> None:
        """See DecoderClient.release: synchronous and idempotent."""
        self.decoder.release(request_id)

    @property
    def queues(self) -> dict[str, asyncio.Queue]:
        return self.decoder.queues

    @property
    def num_registered(self) -> int:
        """Requests with a queue: sent to the decoder and neither finished nor released."""
        return len(self.decoder.queues)

    @property
    def stats(self) -> protocol.EngineStatsSnapshot:
        return self.decoder.stats

    @property
    def abort_messages_sent(self) -> int:
        return self.ended.abort_messages_sent

    # ---- the encoder -------------------------------------------------------------------

    async def transcribe(self, samples, requester: Requester = ANONYMOUS) -> protocol.AudioTranscript:
        """See EncoderClient.transcribe."""
        return await self.encoder.transcribe(samples, requester)

    @property
    def transcribe_timeout_s(self) -> float:
        return self.encoder.transcribe_timeout_s

    @property
    def encoder_stats(self) -> protocol.EncoderStats:
        return self.encoder.stats

    @property
    def items_sent_cached(self) -> int:
        return self.encoder.items_sent_cached

    @property
    def items_resent(self) -> int:
        return self.encoder.items_resent

    # ---- voice (the talker) ------------------------------------------------------------

    @property
    def voice_ready(self) -> bool:
        return self.talker.voice_ready

    @property
    def voice_status(self) -> str:
        return self.supervisor.voice_status

    @property
    def speaks_itself(self) -> bool:
        return self.talker.speaks_itself

    @property
    def voices(self) -> list[str]:
        return self.talker.voices

    def speaker(self, voice: str) -> str:
        """See TalkerClient.speaker."""
        return self.talker.speaker(voice)

    def speech_options(self, request_id: str, voice: str, sample_rate: int,
                       seed: int | None = None) -> protocol.SpeechOptions | None:
        """See TalkerClient.speech_options."""
        return self.talker.speech_options(request_id, voice, sample_rate, seed)

    def open_speech(self, request_id: str, requester: Requester = ANONYMOUS) -> asyncio.Queue:
        """See TalkerClient.open_speech."""
        return self.talker.open_speech(request_id, requester)

    async def speak(self, request_id: str, text: str, *, sample_rate: int, final: bool = False,
                    speed: float = 1.0) -> None:
        await self.talker.speak(request_id, text, sample_rate=sample_rate, final=final, speed=speed)

    def cancel_speech(self, request_id: str) -> None:
        """Stop speaking an answer (barge-in, a client gone); idempotent and synchronous."""
        self.talker.cancel_speech(request_id)

    # ---- what the supervisor reports ----------------------------------------------------

    def _route(self, message: protocol.WorkerOutput) -> None:
        workers = self.supervisor
        if isinstance(message, protocol.StepOutputs):
            workers.heard_from("decoder")
            self.decoder.step_outputs(message)
            if message.prefix_changes is not None and self.on_cache_changes is not None:
                self.on_cache_changes(message.prefix_changes)
        elif isinstance(message, protocol.Heartbeat):
            workers.heard_from(message.worker)
        elif isinstance(message, protocol.EncoderStats):
            self.encoder.stats = message
        elif isinstance(message, protocol.CacheChanges):
            self.encoder.cache_changed(message)
            if self.on_cache_changes is not None:
                self.on_cache_changes(message)
        elif isinstance(message, protocol.ItemsMissing):
            self.encoder.resend_pixels(set(message.mm_hashes))
        elif isinstance(message, protocol.WorkerReady):
            workers.worker_ready(message)
        elif isinstance(message, protocol.AudioTranscript):
            workers.heard_from("encoder")
            self.encoder.transcript_arrived(message)
        elif isinstance(message, protocol.WorkerFailed):
            workers.worker_failed(message)

    def _worker_lost(self, worker: str, reason: str) -> None:
        if self.on_lost is not None:
            self.on_lost(worker, reason)
        if worker == "talker":
            # Text goes on; only the answers being spoken end, with the reason.
            self.talker.fail_speech(reason)
        elif worker == "decoder":
            self.decoder.lost(reason)
        else:
            # Only requests with items needed the encoder; its successor starts empty.
            self.ended.releases.clear()
            self.decoder.fail_in_flight(reason, only=set(self.encoder.with_items))
            self.encoder.lost(reason)
            if "decoder" in self.supervisor.running:
                # Before any request that reaches the encoder's successor: the decoder stops
                # waiting for items asked of the dead one (they would time out one by one).
                self.supervisor.send_in_background("decoder", protocol.encode(protocol.EncoderLost(reason)))

    def _fail_in_flight(self, reason: str) -> None:
        """The engine failed for good: everything in flight fails with the reason."""
        self.decoder.fail_in_flight(reason)
        self.encoder.fail_transcripts(reason)
        self.talker.fail_speech(reason)
