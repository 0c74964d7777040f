"""The front end's side of the encoder: requests' image items, the mirror of its cache, clips
to transcribe.

Requests with images register their preprocessed items with the encoder (pixels as frames)
before they go to the decoder, and release them when they end; the decoder asks the encoder
for embeddings itself, on sockets of their own. Items the encoder's global cache holds, as it
last reported, are registered without their pixels; if it dropped one meanwhile it asks, and
any live request that holds the item sends its pixels again.

With voice on, the encoder also transcribes clips (`transcribe`), at most as many at once as
the `transcriptions` share allows, server-wide and per tenant and client.
"""

from __future__ import annotations

import asyncio
import itertools

from engine import protocol
from engine.array_frames import item_frames
from frontend.ended_requests import EndedRequests
from frontend.engine_errors import EngineUnavailable, voice_slot
from frontend.tenancy import ANONYMOUS, FairShare, Requester

# A clip's transcript may take the encoder's own deadline (how long a clip may wait for the
# recognizer, --encoder-timeout) plus this long to recognize it before the request fails: the
# encoder answers a clip that waited too long itself (429 voice_busy), and the front end's
# deadline must not fire first. A hung encoder is caught by the watchdog sooner; this bounds a
# lost reply.
RECOGNITION_ALLOWANCE_S = 60.0


class EncoderClient:
    def __init__(self, workers, ended: EndedRequests, transcriptions: FairShare) -> None:
        self.workers = workers  # the WorkerSupervisor
        self.ended = ended
        self.transcriptions = transcriptions
        # Requests whose items the encoder holds for them, until they end: their items, whose
        # pixels are sent again if the encoder asks (its cache dropped one sent without).
        self.with_items: dict[str, list] = {}
        # What the encoder's global cache holds, as it last reported: cached items are
        # registered without their pixels.
        self.cache_mirror: set[str] = set()
        # For /metrics: items registered without pixels (the mirror said cached), pixels resent.
        self.items_sent_cached = 0
        self.items_resent = 0
        self.stats = protocol.EncoderStats()
        # Clips waiting for their transcript.
        self.transcripts: dict[str, asyncio.Future] = {}
        self._clip_ids = itertools.count()

    # ---- items ------------------------------------------------------------------------

    async def register_items(self, request_id: str, items) -> None:
        self.with_items[request_id] = list(items)
        headers, frames = item_frames(list(items), self.cache_mirror)
        self.items_sent_cached += len(headers) - len(frames)
        register = protocol.encode(protocol.RegisterItems(request_id, headers))
        await self.workers.send("encoder", [register, *frames])

    def release_items(self, request_id: str) -> None:
        if request_id in self.with_items:
            del self.with_items[request_id]
            if "encoder" in self.workers.running:
                self.ended.release_items(request_id)

    def cache_changed(self, message: protocol.CacheChanges) -> None:
        self.cache_mirror.difference_update(message.evicted)
        self.cache_mirror.update(message.added)

    def resend_pixels(self, wanted: set[str]) -> None:
        """Register again, with pixels, the items the encoder could not find (a race between
        its eviction and our mirror): any live request that holds them will do."""
        for request_id, items in self.with_items.items():
            found = [item for item in items if item.mm_hash in wanted]
            if found:
                wanted -= {item.mm_hash for item in found}
                self.items_resent += len(found)
                headers, frames = item_frames(found)
                message = [protocol.encode(protocol.RegisterItems(request_id, headers)), *frames]
                self.workers.send_in_background("encoder", message)
            if not wanted:
                return

    def lost(self, reason: str) -> None:
        """The encoder is gone: its successor starts empty, and no clip will be answered."""
        self.with_items.clear()
        self.cache_mirror.clear()
        self.fail_transcripts(reason)

    # ---- transcripts ------------------------------------------------------------------

    async def transcribe(self, samples, requester: Requester = ANONYMOUS) -> protocol.AudioTranscript:
        """The encoder's transcript of a clip (float32 mono samples at 16 kHz); raises
        EngineUnavailable when voice is off or the encoder is gone or never answers, VoiceBusy
        when the server, or this requester's share of it, recognizes as many clips as it may."""
        import numpy as np

        if not self.workers.config.voice:
            raise EngineUnavailable("voice is off on this server (--no-voice)")
        slot = voice_slot(self.transcriptions, requester)
        request_id = f"clip-{next(self._clip_ids)}"
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.transcripts[request_id] = future
        # The share counts the encoder's work, not this caller's wait: a caller that gives up
        # (a client gone, speech that resumed) leaves its clip being recognized, so the slot
        # stays taken until the encoder answers, fails or the timeout passes.
        expiry = loop.call_later(self.transcribe_timeout_s, self._expire_clip, request_id)
        def clip_done(done: asyncio.Future) -> None:
            slot.release()
            expiry.cancel()
            self.transcripts.pop(request_id, None)
            if not done.cancelled():
                done.exception()  # read here: a caller that gave up never will

        future.add_done_callback(clip_done)
        try:
            header = protocol.encode(protocol.TranscribeAudio(request_id, owner=f"{requester.tenant}/{requester.client}"))
            await self.workers.send("encoder", [header, np.ascontiguousarray(samples, dtype=np.float32).data])
        except BaseException:
            future.cancel()  # the clip never reached the encoder
            raise
        return await asyncio.shield(future)

    def _expire_clip(self, request_id: str) -> None:
        future = self.transcripts.pop(request_id, None)
        if future is not None and not future.done():
            future.set_exception(EngineUnavailable(f"no transcript within {self.transcribe_timeout_s:g} s"))

    @property
    def transcribe_timeout_s(self) -> float:
        return self.workers.config.encoder_timeout_s + RECOGNITION_ALLOWANCE_S

    def transcript_arrived(self, message: protocol.AudioTranscript) -> None:
        future = self.transcripts.pop(message.request_id, None)
        if future is not None and not future.done():
            future.set_result(message)

    def fail_transcripts(self, reason: str) -> None:
        for future in self.transcripts.values():
            if not future.done():
                future.set_exception(EngineUnavailable(f"engine unavailable: {reason}"))
        self.transcripts.clear()
