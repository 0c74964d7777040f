"""Spoken answers from an omni model offline: thinker -> talker -> codec in one process.

The thinker is the LLMEngine's own model; its runner keeps the talker's rows in the
hidden-state store. After every thinker step the rows of newly forwarded positions are handed
to the talker (chunked hand-off: the talker starts on the thinker's first reply token, not
when the thinker is done); the talker is a second engine core (scheduler, paged KV,
continuous batching) whose requests wait for rows that have not arrived; a finished answer's
codes become its waveform through the codec.

The talker's executor lives in workers/ and is named here as data, as the LLM names its own.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field

import msgspec
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams

TALKER_EXECUTOR = "workers.talker_runner:TalkerExecutor"
TALKER_ROWS = "workers.talker_runner:TalkerRows"

# Qwen2.5-Omni's generate: the talker samples (top-k 40, top-p 0.8, temperature 0.9) with a
# repetition penalty of 1.05, and never emits its codec-bos token.
DEFAULT_TALKER_PARAMS = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, max_tokens=4096)


def _resolve(name: str):
    module, attribute = name.split(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass
class _Answer:
    """One spoken answer in flight: its thinker request, its talker rows, what it said."""

    request_id: str
    num_prompt_tokens: int
    speaker: str
    rows: object  # TalkerRows
    params: SamplingParams
    # Thinker positions whose rows were handed to the talker.
    sent: int = 0
    talker_started: bool = False
    thinker_done: bool = False
    codes: list[int] = field(default_factory=list)
    waveform: torch.Tensor | None = None
    error: str | None = None


class OmniSpeech:
    """`handoff`: "chunked" starts the talker on the thinker's first reply token; "whole" waits
    for the thinker's whole answer (for measuring what the chunked hand-off saves)."""

    def __init__(self, engine, talker_config: EngineConfig | None = None, handoff: str = "chunked") -> None:
        if handoff not in ("chunked", "whole"):
            raise ValueError(f"handoff must be chunked or whole, got {handoff!r}")
        self.handoff = handoff
        from transformers import AutoConfig

        from engine.adapters.qwen2_5_omni_talker import TalkerSpec

        executor = engine.core.executor
        if engine.core._step_thread is not None:
            # Rows are read between thinker steps: none may be running then.
            raise ValueError("spoken answers offline need async_scheduling off")
        self.engine = engine
        self.thinker_runner = executor.runner
        if self.thinker_runner.hidden_store is None:
            raise ValueError("spoken answers need an omni model loaded with omni_speech=True "
                             "(LLM(model, omni_speech=True))" if engine.adapter is not None
                             and engine.adapter.talker_row_width() is not None else "this model has no talker")
        self.adapter = engine.adapter
        device, dtype = executor.device, executor.model_dtype
        self.spec = TalkerSpec(engine.model_path, AutoConfig.from_pretrained(engine.model_path),
                               executor.model.get_input_embeddings())
        self.streams: dict[str, object] = {}
        # As many blocks as the thinker's pool (the talker's are smaller: fewer, narrower layers).
        # No prefix caching: its prompt tokens are all the codec's mask code, whatever was said.
        config = talker_config or dataclasses.replace(
            engine.config, enable_prefix_caching=False, async_scheduling=False, encoder_cache_size=0,
            num_kv_blocks=engine.core.sizes.num_kv_blocks, max_model_len=None)
        self.talker = EngineCore(config, _resolve(TALKER_EXECUTOR)(config, self.spec, self.streams, device, dtype))
        self.codec = self.spec.load_codec(device)
        # The store's dtype (the thinker's): the rows the talker reads, kept as they come.
        self.rows_dtype = self.thinker_runner.hidden_store.rows.dtype
        self._rows_class = _resolve(TALKER_ROWS)
        self.answers: dict[str, _Answer] = {}

    def check(self, speaker: str, num_prompt_tokens: int, talker_params: SamplingParams) -> None:
        """Raises ValueError if `add` would be refused, or the talker could never take the answer."""
        if speaker not in self.spec.speakers:
            raise ValueError(f"unknown voice {speaker!r}; this model has {sorted(self.spec.speakers)}")
        probe = Request("probe", self.spec.prompt_token_ids(num_prompt_tokens), talker_params)
        self.talker.check_request(probe)

    def add(self, request_id: str, prompt_token_ids: list[int], placeholders, speaker: str,
            talker_params: SamplingParams) -> None:
        """Speak the answer of the thinker request `request_id` (added to the thinker, checked);
        `talker_params` as `talker_params()` made them."""
        size = len(prompt_token_ids)
        positions, delta = None, 0
        if placeholders:
            # The talker's prompt is the thinker's, plus its text-bos and first reply positions.
            positions, delta = self.adapter.prompt_positions(size + 2, placeholders)
        rows = self._rows_class(num_prompt_rows=size, pad=self.spec.text_pad, mrope_positions=positions,
                                mrope_delta=delta)
        params = talker_params
        self.answers[request_id] = _Answer(request_id, size, speaker, rows, params)

    def talker_params(self, params: SamplingParams) -> SamplingParams:
        """It stops at the codec's pad or end code, and never says its codec-bos code (a bias
        of -100: transformers' suppress_tokens sets -inf, which OpenAI's bias range excludes)."""
        return msgspec.structs.replace(params, stop_token_ids=list(self.spec.stop_token_ids),
                                       logit_bias={**params.logit_bias, self.spec.codec_bos: -100.0})

    def after_thinker_step(self, outputs) -> None:
        """Hand the rows of the positions the thinker just forwarded to the talker. An answer
        whose text failed or was aborted is not spoken: it is dropped, talker request and all."""
        for out in outputs:
            answer = self.answers.get(out.request_id)
            if answer is None or answer.thinker_done:
                continue
            if out.finish_reason in ("error", "abort"):
                answer.error = out.error or "the answer's text was aborted"
                self.drop(out.request_id)
                continue
            # Every token but the last sampled one has been forwarded.
            forwarded = len(out.prompt_token_ids) + len(out.token_ids) - 1
            if forwarded > answer.sent:
                rows = self.thinker_runner.talker_rows(out.request_id, answer.sent, forwarded)
                if rows is None:
                    # A hit whose rows are not written yet; the next step has them (a finished
                    # request's own forward wrote all of its rows, so this is never its last).
                    continue
                self._append(answer, answer.sent, rows)
                answer.sent = forwarded
            if out.finished:
                answer.thinker_done = True
                answer.rows.finish(self.spec.text_eos.to(self.rows_dtype))
            self._start_or_feed(answer)

    def drop(self, request_id: str) -> None:
        """Forget an answer (failed, aborted, or its caller gave up), its talker request too."""
        answer = self.answers.pop(request_id, None)
        if answer is not None and answer.talker_started:
            self.talker.abort_requests([request_id])
        self.streams.pop(request_id, None)

    def _append(self, answer: _Answer, start: int, rows: torch.Tensor) -> None:
        prompt = answer.num_prompt_tokens
        if start < prompt <= start + rows.shape[0]:
            # The speaker's text-bos row sits between the prompt's rows and the reply's.
            cut = prompt - start
            answer.rows.append(rows[:cut])
            answer.rows.append(self.spec.text_bos[answer.speaker].to(rows.dtype).unsqueeze(0))
            rows = rows[cut:]
        if rows.shape[0]:
            answer.rows.append(rows)

    def _start_or_feed(self, answer: _Answer) -> None:
        known = answer.rows.known_positions
        if not answer.talker_started:
            prompt = answer.num_prompt_tokens + 2
            if (known is not None and known < prompt) or (self.handoff == "whole" and not answer.thinker_done):
                return
            self.streams[answer.request_id] = answer.rows
            request = Request(answer.request_id, self.spec.prompt_token_ids(answer.num_prompt_tokens),
                              answer.params, input_limit=known)
            self.talker.add_request(request)
            answer.talker_started = True
        else:
            self.talker.scheduler.set_input_limit(answer.request_id, known)

    def talker_step(self) -> list[_Answer]:
        """One talker step; the answers it finished, with their codes and waveforms."""
        done = []
        for out in self.talker.step():
            answer = self.answers[out.request_id]
            answer.codes.extend(out.new_token_ids)
            if out.finished:
                codes = answer.codes
                while codes and codes[-1] in self.spec.stop_token_ids:
                    codes.pop()
                if out.error is not None:
                    answer.error = out.error
                elif codes:
                    answer.waveform = self.codec.waveform(codes, self.spec.speakers[answer.speaker])
                else:  # it ended before its first code: nothing to say
                    answer.waveform = torch.zeros(0)
                self.streams.pop(answer.request_id, None)
                done.append(self.answers.pop(answer.request_id))
        return done

    @property
    def busy(self) -> bool:
        return bool(self.answers)
