"""Spoken answers from an omni model offline: thinker -> talker -> codec in one process.

The thinker is the LLMEngine's own model; its runner keeps the talker's rows in the
hidden-state store. After every thinker step the rows of newly forwarded positions go from
the thinker's side (engine/thinker_rows.py) straight to the talker's (engine/talker_stage.py):
the same hand-off the server makes between its decoder and talker processes, without the
sockets in between.
"""

from __future__ import annotations

import dataclasses

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.talker_stage import DEFAULT_TALKER_PARAMS, SpokenAnswer, TalkerStage
from engine.thinker_rows import TalkerPrompt, ThinkerRowsFeed

__all__ = ["DEFAULT_TALKER_PARAMS", "OmniSpeech"]


class OmniSpeech:
    """`handoff`: "chunked" starts the talker on the thinker's first reply token; "whole" waits
    for the thinker's whole answer (for measuring what the chunked hand-off saves)."""

    def __init__(self, engine, talker_config: EngineConfig | None = None, handoff: str = "chunked") -> None:
        from engine.adapters import talker_spec

        executor = engine.core.executor
        if engine.core._step_thread is not None:
            # Rows are read between thinker steps: none may be running then.
            raise ValueError("spoken answers offline need async_scheduling off")
        self.engine = engine
        runner = executor.runner
        if runner.hidden_store is None:
            raise ValueError("spoken answers need an omni model loaded with omni_speech=True "
                             "(LLM(model, omni_speech=True))" if engine.adapter is not None
                             and engine.adapter.talker_row_width() is not None else "this model has no talker")
        self.adapter = engine.adapter
        self.feed = ThinkerRowsFeed(runner)
        spec = talker_spec(engine.model_path, executor.model.get_input_embeddings())
        # As many blocks as the thinker's pool (the talker's are smaller: fewer, narrower layers).
        # No prefix caching: its prompt tokens are all the codec's mask code, whatever was said.
        config = talker_config or dataclasses.replace(
            engine.config, enable_prefix_caching=False, async_scheduling=False, encoder_cache_size=0,
            num_kv_blocks=engine.core.sizes.num_kv_blocks, max_model_len=None)
        self.stage = TalkerStage(spec, config, executor.device, executor.model_dtype,
                                 runner.hidden_store.rows.dtype, handoff)
        self.spec, self.talker = spec, self.stage.talker

    @property
    def answers(self) -> dict[str, SpokenAnswer]:
        return self.stage.answers

    @property
    def streams(self) -> dict:
        return self.stage.streams

    @property
    def busy(self) -> bool:
        return self.stage.busy

    def talker_params(self, params: SamplingParams) -> SamplingParams:
        return self.stage.talker_params(params)

    def talker_prompt(self, prompt_token_ids: list[int], placeholders) -> TalkerPrompt:
        return self.adapter.talker_prompt(prompt_token_ids, placeholders)

    def check(self, speaker: str, prompt: TalkerPrompt, talker_params: SamplingParams) -> None:
        self.stage.check(speaker, prompt, talker_params)

    def add(self, request_id: str, prompt_token_ids: list[int], prompt: TalkerPrompt, speaker: str,
            talker_params: SamplingParams) -> None:
        """Speak the answer of the thinker request `request_id` (added to the thinker, checked);
        `talker_params` as `talker_params()` made them."""
        self.stage.add(request_id, prompt, speaker, talker_params)
        self.feed.add(request_id, len(prompt_token_ids), prompt)

    def after_thinker_step(self, outputs) -> None:
        """Hand the rows of the positions the thinker just forwarded to the talker. An answer
        whose text failed or was aborted is not spoken: it is dropped, talker request and all."""
        for chunk in self.feed.after_step(outputs):
            self.stage.receive(chunk.request_id, chunk.start, chunk.rows, chunk.ended, chunk.error)

    def drop(self, request_id: str) -> None:
        """Forget an answer (failed, aborted, or its caller gave up), its talker request too."""
        self.feed.drop(request_id)
        self.stage.drop(request_id)

    def talker_step(self) -> list[SpokenAnswer]:
        """One talker step; the answers it finished, with their codes and waveforms (each
        decoded whole)."""
        finished = [update.answer for update in self.stage.step() if update.finished]
        for answer in finished:
            if answer.error is None:
                answer.waveform = self.stage.waveform(answer)
        return finished
