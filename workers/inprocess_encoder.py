"""The encoder in this process: vision tower + projector, the global encoder cache, and the
raw items of live requests. The offline LLM uses it directly; the encoder process wraps the
same class behind its sockets.

Asked for several items at once, it looks each up in the cache and encodes all the misses
in one batch. Deliveries wait in a list until the engine core polls.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.encoder_cache import EncoderCache
from engine.mm_inputs import ProcessedItem

logger = logging.getLogger("antiphon")


class InProcessEncoder:
    def __init__(self, adapter, dtype: torch.dtype, device: torch.device, cache_budget: int,
                 track_cache_changes: bool = False) -> None:
        self.adapter = adapter
        self.tower = adapter.load_encoder(dtype, device)
        self.cache = EncoderCache(cache_budget, track_cache_changes)
        # mm_hash -> (item, ids of the live requests that sent it). An item registered without
        # pixels (the frontend believed it cached) can only be served from the cache.
        self._items: dict[str, tuple[ProcessedItem, set[str]]] = {}
        self._by_request: dict[str, list[str]] = {}
        self._ready: list[tuple[str, object, str | None]] = []

    # ---- the EmbeddingSource interface (engine/executor.py) ---------------------------------

    def register(self, request_id: str, items: list[ProcessedItem]) -> None:
        hashes = self._by_request.setdefault(request_id, [])
        for item in items:
            entry = self._items.get(item.mm_hash)
            if entry is None or (entry[0].tower_input is None and item.tower_input is not None):
                entry = self._items[item.mm_hash] = (item, entry[1] if entry else set())
            entry[1].add(request_id)
            if item.mm_hash not in hashes:
                hashes.append(item.mm_hash)

    def release(self, request_id: str) -> None:
        for mm_hash in self._by_request.pop(request_id, ()):
            entry = self._items.get(mm_hash)
            if entry is not None:
                entry[1].discard(request_id)
                if not entry[1]:
                    del self._items[mm_hash]

    def request(self, mm_hashes: list[str]) -> None:
        misses = []
        for mm_hash in mm_hashes:
            embeddings = self.cache.get(mm_hash)
            if embeddings is not None:
                self._ready.append((mm_hash, embeddings, None))
            elif mm_hash in self._items and self._items[mm_hash][0].tower_input is not None:
                misses.append(self._items[mm_hash][0])
            else:
                self._ready.append((mm_hash, None, "the item is not known to the encoder (its request ended?)"))
        if misses:
            self._ready.extend(self.encode(misses))

    def knows(self, mm_hash: str) -> bool:
        """Whether an ask for this item can be served: cached, or registered with its pixels."""
        if mm_hash in self.cache:
            return True
        entry = self._items.get(mm_hash)
        return entry is not None and entry[0].tower_input is not None

    def cost_of(self, mm_hash: str) -> int:
        """Embeddings an ask makes the tower compute: none for a cached or unknown item."""
        entry = self._items.get(mm_hash)
        return 0 if entry is None or mm_hash in self.cache else entry[0].num_embeddings

    def registered_without_pixels(self, mm_hash: str) -> bool:
        entry = self._items.get(mm_hash)
        return entry is not None and entry[0].tower_input is None

    def poll(self) -> list[tuple[str, object, str | None]]:
        ready, self._ready = self._ready, []
        return ready

    # ---- encoding ------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, items: list[ProcessedItem]) -> list[tuple[str, object, str | None]]:
        try:
            outputs = self.adapter.encode_items(self.tower, items)
        except Exception as exc:  # a bad item must fail its requests, not the engine
            if len(items) > 1:
                # One bad item must not fail the others batched with it: one at a time.
                return [result for item in items for result in self.encode([item])]
            logger.exception("encoding item %s failed", items[0].mm_hash[:16])
            return [(items[0].mm_hash, None, f"{type(exc).__name__}: {exc}")]
        self.cache.stats.items_encoded += len(items)
        results = []
        for item, embeddings in zip(items, outputs):
            embeddings = embeddings.detach()
            self.cache.put(item.mm_hash, embeddings, item.num_embeddings)
            results.append((item.mm_hash, embeddings, None))
        return results

    def warm_up(self, batch_sizes: list[int], example: ProcessedItem) -> float:
        """Run the tower once per batch size the engine will use, so the first real requests
        do not pay for lazy initialisation (seed 001); returns the seconds it took."""
        started = time.perf_counter()
        with torch.inference_mode():
            for size in batch_sizes:
                self.adapter.encode_items(self.tower, [example] * size)
        return time.perf_counter() - started

