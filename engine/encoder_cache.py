"""The global encoder cache: item embeddings keyed by mm_hash, shared by every request.

It lives where the encoder runs (the encoder process, or the offline LLM's process), so the
same image sent by a thousand requests is encoded once. Least recently used entries go first
when the budget, counted in embeddings, is exceeded. Nothing here is pinned: a request that
still needs an item holds its own copy in the decoder (engine/embedding_tracker.py) and its
raw item in the encoder, so an evicted entry is simply encoded again when asked.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.change_log import ChangeLog


@dataclass
class EncoderCacheStats:
    queries: int = 0
    hits: int = 0
    items_encoded: int = 0
    evictions: int = 0


class EncoderCache:
    def __init__(self, budget: int, track_changes: bool = False) -> None:
        self.budget = budget
        # The encoder process reports what entered and left the cache, so the frontend can
        # keep a mirror of it and not resend the pixels of a cached item.
        self.track_changes = track_changes
        self.changes: ChangeLog[str] = ChangeLog()
        self.used = 0
        self._entries: OrderedDict[str, object] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.stats = EncoderCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def get(self, mm_hash: str):
        """The embeddings, or None; counts a query and, when found, a hit."""
        self.stats.queries += 1
        embeddings = self._entries.get(mm_hash)
        if embeddings is not None:
            self.stats.hits += 1
            self._entries.move_to_end(mm_hash)
        return embeddings

    def put(self, mm_hash: str, embeddings, size: int) -> None:
        if mm_hash in self._entries or size > self.budget:
            return  # an item larger than the whole cache is delivered, not kept
        while self.used + size > self.budget:
            old, _ = self._entries.popitem(last=False)
            self.used -= self._sizes.pop(old)
            self.stats.evictions += 1
            if self.track_changes:
                self.changes.removed(old)
        self._entries[mm_hash] = embeddings
        self._sizes[mm_hash] = size
        self.used += size
        if self.track_changes:
            self.changes.added(mm_hash)

    def take_changes(self) -> tuple[list[str], list[str]]:
        """(added, evicted) since the last call, netted per item (engine/change_log.py)."""
        added, evicted, _ = self.changes.take()
        return added, evicted
