"""The ids of answers a talker has ended (finished, failed, cancelled), remembered so that
input still on its way for them (text, thinker rows) is dropped, not taken for a new answer.
Bounded: past `limit` ids the oldest are forgotten."""

from __future__ import annotations

from collections import OrderedDict


class EndedAnswers:
    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, answer_id: str) -> None:
        self._ids[answer_id] = None
        self._ids.move_to_end(answer_id)
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __contains__(self, answer_id: str) -> bool:
        return answer_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)
