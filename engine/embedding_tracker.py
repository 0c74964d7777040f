"""The scheduler's books on multimodal embeddings: which items the model runner holds, which
the encoder has been asked for, and who still needs them, within a budget counted in
embeddings.

An item's embeddings are asked for as soon as a request that needs them is known (so the
text before an image prefills while the image is encoded), held by the runner while some
request still has tokens of that item to compute, and dropped (told to the runner with the
next step, after the step that used them has run) once every such request is past it.
Items a prefix-cache hit covers are never asked for. Tokens of an item whose embeddings
have not arrived are never scheduled: `schedulable` cuts a chunk at the item's start.

The budget bounds the runner's memory: an item is asked for only if it fits. A request's
claims are always a prefix of the items it still needs (claiming stops at the first item
that does not fit), so whatever a request holds, it holds the item it needs next and can
progress through it. Claims of waiting requests give way, whole request by whole request,
newest first, to a running request or the head of the queue, so a waiting request can never
block a running one; an item larger than the whole budget is refused when its request arrives. An item that does not arrive within the timeout fails the
requests that need it: nothing waits forever.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request import MultiModalPlaceholder, Request


@dataclass
class _Entry:
    size: int
    users: set[str] = field(default_factory=set)
    # When it was asked for; None once its embeddings are in the runner.
    requested_at: float | None = None

    @property
    def available(self) -> bool:
        return self.requested_at is None


class EmbeddingTracker:
    def __init__(self, budget: int, timeout_s: float) -> None:
        self.budget = budget
        self.timeout_s = timeout_s
        self.entries: dict[str, _Entry] = {}
        self.used = 0
        # Filled by one scheduling pass, taken by the core after it.
        self.to_request: list[str] = []
        # Arrived embeddings and drops to hand the runner with the next step, in order.
        self.arrived: dict[str, object] = {}
        self.to_free: list[str] = []
        # Counters for stats: items asked of the encoder, and embeddings received.
        self.num_requested = 0

    # ---- what a request needs -----------------------------------------------------------

    @staticmethod
    def pending_items(request: Request, computed: int) -> list[MultiModalPlaceholder]:
        """Items with tokens at or after `computed` (a prefix hit covers the rest)."""
        return [p for p in request.mm_placeholders if p.end > computed]

    def holds_all(self, request: Request, computed: int) -> bool:
        """Whether every item the request needs from `computed` on is already claimed by it."""
        for item in self.pending_items(request, computed):
            entry = self.entries.get(item.mm_hash)
            if entry is None or request.request_id not in entry.users:
                return False
        return True

    def check_fits(self, request: Request) -> None:
        for item in request.mm_placeholders:
            if item.length > self.budget:
                raise ValueError(
                    f"an {item.modality} of {item.length} embeddings is larger than the encoder cache budget "
                    f"of {self.budget} embeddings (encoder_cache_size)")

    def claim(self, request: Request, computed: int, yielding: Sequence[Request] = ()) -> bool:
        """Hold or ask for the items the request still needs, in order, up to the first that
        does not fit. Returns False then (the caller stops claiming for later requests: first
        come, first served). `yielding`: waiting requests, newest first, whose claims may be
        released to make room (the request itself is never among them)."""
        for item in self.pending_items(request, computed):
            entry = self.entries.get(item.mm_hash)
            if entry is not None:
                entry.users.add(request.request_id)
                continue
            for other in yielding:
                if self.used + item.length <= self.budget:
                    break
                if other is not request:
                    self.release(other)
            if self.used + item.length > self.budget:
                return False
            self.entries[item.mm_hash] = _Entry(item.length, {request.request_id}, time.monotonic())
            self.used += item.length
            self.to_request.append(item.mm_hash)
            self.num_requested += 1
        return True

    def schedulable(self, request: Request, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` can run: up to the first item whose
        embeddings the runner does not hold yet."""
        end = start + num_new
        for item in request.mm_placeholders:
            if item.offset >= end:
                break
            if item.end <= start:
                continue
            entry = self.entries.get(item.mm_hash)
            if entry is None or not entry.available:
                return max(0, item.offset - start)
        return num_new

    # ---- lifetimes ---------------------------------------------------------------------

    def release_done(self, request: Request) -> None:
        """Drop the request's claim on items its scheduled tokens have passed."""
        for item in request.mm_placeholders:
            if item.end <= request.num_computed_tokens:
                self._unuse(item.mm_hash, request.request_id)

    def release(self, request: Request) -> None:
        """The request finished or was preempted: it needs none of its items now."""
        for item in request.mm_placeholders:
            self._unuse(item.mm_hash, request.request_id)

    def _unuse(self, mm_hash: str, request_id: str) -> None:
        entry = self.entries.get(mm_hash)
        if entry is None or request_id not in entry.users:
            return
        entry.users.discard(request_id)
        if not entry.users:
            self._drop(mm_hash)

    def _drop(self, mm_hash: str) -> None:
        entry = self.entries.pop(mm_hash)
        self.used -= entry.size
        if self.arrived.pop(mm_hash, None) is None and entry.available:
            self.to_free.append(mm_hash)

    def on_arrival(self, mm_hash: str, embeddings) -> bool:
        """Takes delivered embeddings; False if they do not have the item's length (the
        caller fails the item's requests rather than feed the model wrong rows)."""
        entry = self.entries.get(mm_hash)
        if entry is None or entry.available:
            return True  # nobody needs it any more (or a duplicate): never reaches the runner
        if getattr(embeddings, "ndim", 0) != 2 or embeddings.shape[0] != entry.size:
            return False
        entry.requested_at = None
        self.arrived[mm_hash] = embeddings
        # Dropped and asked for again before the runner heard of the drop: the runner
        # replaces its copy with these (same content) and must keep them.
        if mm_hash in self.to_free:
            self.to_free.remove(mm_hash)
        return True

    def users_of(self, mm_hash: str) -> set[str]:
        entry = self.entries.get(mm_hash)
        return set(entry.users) if entry is not None else set()

    def overdue(self, now: float | None = None) -> list[str]:
        """Items asked for longer ago than the timeout."""
        now = time.monotonic() if now is None else now
        return [h for h, e in self.entries.items()
                if e.requested_at is not None and now - e.requested_at > self.timeout_s]

    @property
    def num_in_flight(self) -> int:
        return sum(1 for e in self.entries.values() if not e.available)

    def take_arrived(self) -> dict[str, object]:
        """Embeddings that arrived since the last step: the runner adds them before the
        step being scheduled now, which may already use them."""
        arrived, self.arrived = self.arrived, {}
        return arrived

    def take_freed(self) -> list[str]:
        """Items no request needs any more: the runner drops them after the step."""
        to_free, self.to_free = self.to_free, []
        return to_free
