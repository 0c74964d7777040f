"""Transitional: the old streaming detokenizer API, as a thin layer over RequestOutputProcessor.

frontend/generation.py still calls it; once it uses engine.output_processor directly, this
module goes. It holds no detokenization or stop-string logic of its own.
"""

from __future__ import annotations

from engine.output_processor import RequestOutputProcessor
from engine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._processor = RequestOutputProcessor(tokenizer, prompt_token_ids, params)
        self._ready = ""

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Returns the stop string these tokens completed, if any."""
        update = self._processor.update(token_ids)
        self._ready += update.text
        return update.stop_reason if update.stopped_by_string else None

    def flush(self) -> None:
        """The request ended: release the text held back for stop strings or a partial character."""
        if not self._processor.finished:
            # Any finish reason releases everything; the caller keeps the real one.
            self._ready += self._processor.update([], "stop").text

    def take_delta(self, finished: bool) -> str:
        delta, self._ready = self._ready, ""
        return delta
