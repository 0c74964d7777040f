"""The encoder process: the vision tower with the global encoder cache.

The frontend registers each request's preprocessed items (pixels as frames) and releases
them when the request ends; the decoder asks for embeddings by mm_hash and gets them back
as frames on its own socket. Every ask that has arrived is served in one batch: cache hits
at once, misses encoded together. An ask for an item not registered yet (the decoder's ask
can overtake the frontend's registration: they travel on different sockets) waits for it.
The frontend keeps a mirror of the cache's contents (from CacheChanges) and sends a cached
item's header without its pixels; if the item left the cache before it was asked for, the
encoder asks the frontend for the pixels (ItemsMissing).
Text-only models have no tower: the process then only answers heartbeats.
With voice on it also holds the speech recognizer (Whisper): speech is audio understanding.
The frontend sends a clip (TranscribeAudio + its samples); a thread of its own recognizes it
(workers/speech/transcription_thread.py), so embeddings and heartbeats never wait for speech,
and sends the transcript to the frontend.

Run by the frontend as `python -m workers.encoder_process --config JSON --input ADDR
--asks ADDR --embeddings ADDR --output ADDR`.
"""

from __future__ import annotations

import argparse
import logging
import time

import msgspec

from engine import protocol
from engine.array_frames import items_from_frames, tensor_frame
from engine.config import EngineConfig, global_encoder_cache_size
from workers.encoder_batches import encoder_batches
from workers.worker_loop import WorkerLoop, worker_main

logger = logging.getLogger("antiphon.encoder")

# Batch sizes warmed up at start (seed 001): the first real batch of a size would otherwise
# pay for lazy initialisation. The asks that arrived together are encoded in batches of at
# most the largest, and of at most as many embeddings as the largest warm-up batch made.
WARM_UP_BATCH_SIZES = (1, 2, 4, 8)


class EncoderWorker:
    def __init__(self, config: EngineConfig, addresses: argparse.Namespace) -> None:
        self.config = config
        self.loop = WorkerLoop("encoder", addresses.input, addresses.output, protocol.decode_encoder_input,
                               handle=self._handle_input, work=self._serve, on_beat=self._beat_stats)
        self.outputs = self.loop.outputs  # where run_worker reports a failure
        self.asks = self.loop.bind_pull(addresses.asks, self._take_ask)  # from the decoder
        self.embeddings = self.loop.connect_push(addresses.embeddings)  # to the decoder
        self.encoder = None
        self.max_batch_embeddings = 0
        # Asked for since the last batch, served together by the next.
        self._asked: list[str] = []
        # Asked for before registered (or registered without pixels): mm_hash -> when asked.
        self.waiting_asks: dict[str, float] = {}
        # Items whose pixels the frontend has been asked for, not yet received.
        self.pixels_wanted: set[str] = set()
        self.output_address = addresses.output
        self.transcriber = None

    def load(self) -> None:
        from transformers import AutoConfig

        from engine.adapters import adapter_for
        from engine.checkpoint import resolve_model_path
        from workers.inprocess_encoder import InProcessEncoder
        from workers.model_loader import resolve_device, resolve_dtype

        path = resolve_model_path(self.config.model)
        model_config = AutoConfig.from_pretrained(path)
        adapter = adapter_for(path, model_config)
        if self.config.voice:
            self._load_recognizer()
        if adapter is not None:
            device = resolve_device(self.config.device)
            dtype = resolve_dtype(self.config.dtype, model_config, device)
            budget = global_encoder_cache_size(self.config, adapter.max_embeddings_per_item(),
                                               adapter.embedding_size() * dtype.itemsize)
            self.encoder = InProcessEncoder(adapter, dtype, device, budget, track_cache_changes=True)
            warm_up_items = adapter.warm_up_items()
            seconds = sum(self.encoder.warm_up(list(WARM_UP_BATCH_SIZES), item) for item in warm_up_items)
            self.max_batch_embeddings = WARM_UP_BATCH_SIZES[-1] * warm_up_items[0].num_embeddings
            logger.info("%s encoder of %s loaded; global cache %d embeddings (%.2f GiB, ~%d of the largest "
                        "items); warmed up batch sizes %s in %.2f s",
                        " and ".join(item.modality for item in warm_up_items), path.name, budget,
                        budget * adapter.embedding_size() * dtype.itemsize / (1 << 30),
                        budget // adapter.max_embeddings_per_item(), list(WARM_UP_BATCH_SIZES), seconds)
        self.loop.ready()

    def _load_recognizer(self) -> None:
        import numpy as np

        from workers.speech.recognizer import SpeechRecognizer
        from workers.speech.transcription_thread import TranscriptionThread

        started = time.perf_counter()
        recognizer = SpeechRecognizer(self.config.asr_model)
        recognizer.transcribe(np.zeros(16000, dtype=np.float32))  # first-call initialisation
        self.transcriber = TranscriptionThread(recognizer, self.loop.context, self.output_address,
                                               max_wait_s=self.config.encoder_timeout_s)
        logger.info("speech recognizer loaded and warmed up in %.2f s", time.perf_counter() - started)

    def run(self) -> None:
        self.loop.run()

    def _handle_input(self, message, frames) -> None:
        if isinstance(message, protocol.TranscribeAudio):
            self._take_clip(message.request_id, message.owner, frames)
            return
        if self.encoder is None:
            return
        if isinstance(message, protocol.RegisterItems):
            try:
                items = items_from_frames(message.items, [f.buffer for f in frames])
            except (ValueError, TypeError) as exc:
                logger.error("request %s: items refused: %s", message.request_id, exc)
                return
            self.encoder.register(message.request_id, items)
        elif isinstance(message, protocol.ReleaseItems):
            for request_id in message.request_ids:
                self.encoder.release(request_id)

    def _take_ask(self, frames) -> None:
        data = frames[0].bytes
        try:
            message = protocol.decode_encoder_input(data)
        except msgspec.DecodeError as exc:
            logger.error("skipped an undecodable ask (%d bytes): %s", len(data), exc)
            return
        if isinstance(message, protocol.EncodeItems):
            self._asked += message.mm_hashes

    def _serve(self) -> None:
        """Serves every ask that has arrived as one batch (the loop's work, once a turn)."""
        asked, self._asked = self._asked, []
        if self.encoder is None:
            for mm_hash in asked:
                self._send(protocol.ItemEmbeddings(mm_hash=mm_hash, error="this model takes no images"))
            return
        now = time.monotonic()
        for mm_hash in asked:
            self.waiting_asks.setdefault(mm_hash, now)
        ready = [h for h in self.waiting_asks if self.encoder.knows(h)]
        for mm_hash in ready:
            del self.waiting_asks[mm_hash]
            self.pixels_wanted.discard(mm_hash)
        missing = [h for h in self.waiting_asks
                   if h not in self.pixels_wanted and self.encoder.registered_without_pixels(h)]
        if missing:
            self.pixels_wanted.update(missing)
            self.loop.send(protocol.ItemsMissing(missing))
        for mm_hash, started in list(self.waiting_asks.items()):
            if now - started > self.config.encoder_timeout_s:
                del self.waiting_asks[mm_hash]
                self.pixels_wanted.discard(mm_hash)
                self._send(protocol.ItemEmbeddings(mm_hash=mm_hash, error="the item was never registered"))
        for chunk in encoder_batches(ready, self.encoder.cost_of, WARM_UP_BATCH_SIZES[-1],
                                     self.max_batch_embeddings):
            # An item sent without pixels may have left the cache while earlier chunks were
            # encoded: it waits for its pixels like any other.
            for mm_hash in [h for h in chunk if not self.encoder.knows(h)]:
                chunk.remove(mm_hash)
                self.waiting_asks[mm_hash] = now
            self.encoder.request(chunk)
            for mm_hash, embeddings, error in self.encoder.poll():
                if error is not None:
                    self._send(protocol.ItemEmbeddings(mm_hash=mm_hash, error=error))
                else:
                    header, frame = tensor_frame(mm_hash, embeddings)
                    self.embeddings.send_multipart([protocol.encode(header), frame], copy=False)
            # A long burst must not look like a hung encoder to the frontend's watchdog.
            self.loop.beat_if_due()
        if ready:
            added, evicted = self.encoder.cache.take_changes()
            if added or evicted:
                self.loop.send(protocol.CacheChanges(added, evicted))
            self._send_stats()  # /metrics follows each batch, not only the heartbeat

    def _take_clip(self, request_id: str, owner: str, frames) -> None:
        import numpy as np

        error = None
        if self.transcriber is None:
            error = "voice is off on this server"
        elif len(frames) != 1 or len(frames[0].buffer) % 4:
            error = "malformed audio frame"
        else:
            samples = np.frombuffer(frames[0].buffer, dtype=np.float32)
            if not np.isfinite(samples).all():
                error = "audio samples must be finite"
        if error is not None:
            self.loop.send(protocol.AudioTranscript(request_id=request_id, error=error))
        else:
            self.transcriber.submit(request_id, samples, owner)

    def _send(self, message: protocol.ItemEmbeddings) -> None:
        self.embeddings.send(protocol.encode(message))

    def _beat_stats(self) -> None:
        if self.encoder is not None:
            self._send_stats()

    def _send_stats(self) -> None:
        cache = self.encoder.cache
        self.loop.send(protocol.EncoderStats(
            items_encoded=cache.stats.items_encoded, cache_queries=cache.stats.queries, cache_hits=cache.stats.hits,
            cache_used=cache.used, cache_budget=cache.budget, cache_items=len(cache)))

    def close(self) -> None:
        if self.transcriber is not None:
            self.transcriber.stop()  # its socket is on the loop's context
        self.loop.close()


def main() -> None:
    worker_main("encoder", EncoderWorker)


if __name__ == "__main__":
    main()
