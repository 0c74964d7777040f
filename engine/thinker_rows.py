"""The thinker's side of the talker hand-off: which rows of which answers are ready after a step.

An omni thinker's runner writes every forwarded position's talker row into the hidden-state
store (workers/model_runner.py). After each thinker step, `ThinkerRowsFeed.after_step` reads
the rows of the positions each spoken answer has forwarded since the last step and returns
them as `RowsChunk`s, in order, ending each answer with a chunk that says how its text ended.
The offline API appends the chunks to the talker's streams in the same process
(engine/omni_speech.py); the decoder process sends them to the talker process as frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RowsChunk:
    """Rows of one answer for thinker positions `start`.. (`rows` may be empty); `ended`: the
    answer's text is over (every row it will have is in this chunk or an earlier one);
    `error`: its text failed or was aborted, so it must not be spoken."""

    request_id: str
    start: int
    rows: torch.Tensor | None
    ended: bool = False
    error: str | None = None


@dataclass
class TalkerPrompt:
    """How an answer's talker prompt is made of its thinker prompt (each family's adapter says,
    from the prompt's tokens: `talker_prompt`).

    The talker reads the thinker's rows of the `kept` ranges of positions below `cut`, then
    its own start rows (the spec's `start_rows`), then every thinker row from `cut` on (the
    reply's, as they come). Rows in `items` ranges are the thinker's reading of an image or
    clip, which some talkers project apart from text rows. `mrope_positions` ([3, talker
    prompt length]) are the talker prompt's; later positions are text positions plus
    `mrope_delta`; None: text positions throughout."""

    cut: int
    kept: list[tuple[int, int]]
    items: list[tuple[int, int]] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0

    @property
    def num_kept(self) -> int:
        return sum(end - start for start, end in self.kept)

    def validate(self) -> None:
        """Raises ValueError unless the ranges are well formed: kept ranges sorted, apart and
        below the cut; item ranges sorted and apart (a peer's message is checked, not trusted)."""
        if not (isinstance(self.cut, int) and self.cut >= 0):
            raise ValueError(f"talker prompt cut {self.cut!r} is not a position")
        for name, ranges, limit in (("kept", self.kept, self.cut), ("items", self.items, None)):
            previous_end = 0
            for start, end in ranges:
                if not (isinstance(start, int) and isinstance(end, int) and previous_end <= start < end
                        and (limit is None or end <= limit)):
                    raise ValueError(f"talker prompt {name} range {start}..{end} is out of order or out of range")
                previous_end = end

    def reads_any(self, start: int, end: int) -> bool:
        """Whether the talker reads any of the thinker positions start..end-1."""
        return end > self.cut or any(s < end and start < e for s, e in self.kept)

    def kept_rows(self, start: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Of `rows` (thinker positions from `start` on, below the cut), the kept ones and their
        item flags; None if none is kept."""
        end = start + rows.shape[0]
        pieces, flags = [], []
        for kept_start, kept_end in self.kept:
            lo, hi = max(kept_start, start), min(kept_end, end)
            if lo >= hi:
                continue
            pieces.append(rows[lo - start:hi - start])
            flag = torch.zeros(hi - lo, dtype=torch.bool)
            for item_start, item_end in self.items:
                if item_start < hi and lo < item_end:
                    flag[max(item_start, lo) - lo:min(item_end, hi) - lo] = True
            flags.append(flag)
        return (torch.cat(pieces), torch.cat(flags)) if pieces else None


class ThinkerRowsFeed:
    def __init__(self, runner) -> None:
        self.runner = runner  # a ModelRunner with a hidden-state store
        # Answers being fed: thinker positions already handed over (or skipped).
        self.sent: dict[str, int] = {}
        # ... their prompt's tokens plus the tokens sampled so far.
        self.num_tokens: dict[str, int] = {}
        # ... and the prompt positions their talker never reads (sorted ranges; never sent).
        self.skipped: dict[str, list[tuple[int, int]]] = {}

    def add(self, request_id: str, num_prompt_tokens: int, prompt: TalkerPrompt | None = None) -> None:
        """Feed an answer; with its `prompt`, only the rows its talker reads are handed over."""
        self.sent[request_id] = 0
        self.num_tokens[request_id] = num_prompt_tokens
        skipped, previous_end = [], 0
        for start, end in (prompt.kept if prompt is not None else [(0, num_prompt_tokens)]):
            if start > previous_end:
                skipped.append((previous_end, start))
            previous_end = end
        if prompt is not None and prompt.cut > previous_end:
            skipped.append((previous_end, prompt.cut))
        self.skipped[request_id] = skipped

    def drop(self, request_id: str) -> None:
        self.sent.pop(request_id, None)
        self.num_tokens.pop(request_id, None)
        self.skipped.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.sent

    def after_step(self, outputs) -> list[RowsChunk]:
        """The rows of the positions the thinker just forwarded, per answer fed (a chunk per run
        of positions its talker reads); an answer that ended (finished, failed, aborted) gets
        its last chunk and is forgotten. `outputs`: the step's outputs (anything with
        request_id, new_token_ids, finish_reason, error)."""
        chunks = []
        for out in outputs:
            sent = self.sent.get(out.request_id)
            if sent is None:
                continue
            if out.finish_reason in ("error", "abort"):
                self.drop(out.request_id)
                chunks.append(RowsChunk(out.request_id, sent, None, ended=True,
                                        error=out.error or "the answer's text was aborted"))
                continue
            self.num_tokens[out.request_id] += len(out.new_token_ids)
            # Every token but the last sampled one has been forwarded.
            forwarded = self.num_tokens[out.request_id] - 1
            new = []
            for start, end in self._read(out.request_id, sent, forwarded):
                rows = self.runner.talker_rows(out.request_id, start, end)
                if rows is None:
                    break  # a hit whose rows are not written yet: the next step has them
                new.append(RowsChunk(out.request_id, start, rows))
                self.sent[out.request_id] = end
            else:
                self.sent[out.request_id] = max(sent, forwarded)
            if out.finished and self.sent[out.request_id] < forwarded:
                # Never expected (a finished request's own forward wrote all of its rows),
                # but an answer must end, not wait for rows that will never come.
                self.drop(out.request_id)
                chunks.append(RowsChunk(out.request_id, sent, None, ended=True,
                                        error="the thinker's rows of the answer were never written"))
                continue
            if out.finished:
                self.drop(out.request_id)
                if new:
                    new[-1].ended = True
                else:
                    new.append(RowsChunk(out.request_id, forwarded, None, ended=True))
            chunks += new
        return chunks

    def _read(self, request_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """The runs of positions start..end-1 that are not skipped."""
        runs = []
        for skip_start, skip_end in self.skipped[request_id]:
            if skip_end <= start:
                continue
            if skip_start >= end:
                break
            if skip_start > start:
                runs.append((start, skip_start))
            start = max(start, skip_end)
        if start < end:
            runs.append((start, end))
        return runs

    def end(self, request_id: str) -> RowsChunk | None:
        """The last chunk of an answer whose text was cut short (a stop string, a client that
        stopped reading): it is spoken up to the rows already handed over, which may run a step
        or two past a stop string (the frontend finds it after the decoder has gone on)."""
        sent = self.sent.get(request_id)
        self.drop(request_id)
        return None if sent is None else RowsChunk(request_id, sent, None, ended=True)
