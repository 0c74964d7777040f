"""Transcripts of spoken chat answers, by audio id, for the tenant that was answered.

OpenAI's multi-turn pattern sends a spoken answer back as `{"role": "assistant", "audio":
{"id": ...}}`; the server puts the answer's transcript in its place. An id is therefore a
capability: it is random (unguessable), it names a transcript only for the tenant (API key)
whose request made it, and only until its `expires_at`. An id that is unknown, expired or
another tenant's reads the same (None), so probing learns nothing.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict


class SpokenAnswerStore:
    def __init__(self, per_tenant: int = 4096, ttl_s: float = 3600.0, clock=time.time) -> None:
        # Per tenant, so one tenant's answers never push out another's; the tenants are the
        # configured keys, so the store's whole size is bounded too.
        self.per_tenant = per_tenant
        self.ttl_s = ttl_s
        self.clock = clock
        self._by_tenant: dict[str, OrderedDict[str, tuple[str, float]]] = {}

    @staticmethod
    def new_id() -> str:
        return f"audio_{secrets.token_hex(16)}"

    def expires_at(self) -> int:
        return int(self.clock() + self.ttl_s)

    def remember(self, tenant: str, audio_id: str, transcript: str, expires_at: float) -> None:
        answers = self._by_tenant.setdefault(tenant, OrderedDict())
        answers[audio_id] = (transcript, expires_at)
        answers.move_to_end(audio_id)
        now = self.clock()
        # Oldest first: expired ones go, then the oldest past the bound.
        while answers and (len(answers) > self.per_tenant or next(iter(answers.values()))[1] <= now):
            answers.popitem(last=False)

    def transcript_of(self, tenant: str, audio_id: str) -> str | None:
        answers = self._by_tenant.get(tenant)
        found = answers.get(audio_id) if answers is not None else None
        if found is None:
            return None
        transcript, expires_at = found
        if expires_at <= self.clock():
            del answers[audio_id]
            return None
        return transcript

    def __len__(self) -> int:
        return sum(len(answers) for answers in self._by_tenant.values())
