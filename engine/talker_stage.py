"""The talker's side of an omni model's spoken answers: rows in, codec tokens and audio out.

A `TalkerStage` owns the talker (a second engine core: scheduler, paged KV, continuous
batching over every answer being spoken) and the codec. It is fed each answer's thinker rows
as `RowsChunk`s (engine/thinker_rows.py) in the order the thinker made them, from the same
process (offline, engine/omni_speech.py) or over ZeroMQ (the talker process); `step` runs one
talker step and returns what each answer said in it. The talker starts an answer once its
prompt's rows are in (chunked hand-off: the thinker's first reply token), not when the
thinker is done; `Request.input_limit` keeps it from running past rows that have not come.

The talker's executor lives in workers/ and is named here as data, as the LLM names its own.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import msgspec
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.thinker_rows import TalkerPrompt

TALKER_EXECUTOR = "workers.talker_runner:TalkerExecutor"
TALKER_ROWS = "workers.talker_runner:TalkerRows"

# Qwen2.5-Omni's generate: the talker samples (top-k 40, top-p 0.8, temperature 0.9) with a
# repetition penalty of 1.05 (a spec's `default_sampling` may say otherwise: Qwen3-Omni's).
DEFAULT_TALKER_PARAMS = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, max_tokens=4096)

HANDOFFS = ("chunked", "whole")


def _resolve(name: str):
    module, attribute = name.split(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass
class SpokenAnswer:
    """One answer being spoken: its talker rows, what it said so far (codes, or frames of codes
    for a talker with code groups)."""

    request_id: str
    prompt: TalkerPrompt
    speaker: str
    rows: object  # TalkerRows
    params: SamplingParams
    talker_prompt_ids: list[int]
    talker_started: bool = False
    thinker_done: bool = False
    # Thinker positions whose rows have arrived, and whether the talker's start rows are in.
    thinker_rows: int = 0
    start_rows_in: bool = False
    codes: list = field(default_factory=list)
    waveform: torch.Tensor | None = None
    error: str | None = None


@dataclass
class SpeechUpdate:
    """What one talker step did for one answer: its new codes, and whether it is `finished`
    (its codes complete, or its `error` set)."""

    answer: SpokenAnswer
    new_codes: list[int]
    finished: bool


class TalkerStage:
    """`handoff`: "chunked" starts the talker on the thinker's first reply token; "whole" waits
    for the thinker's whole answer (for measuring what the chunked hand-off saves)."""

    def __init__(self, spec, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 rows_dtype: torch.dtype, handoff: str = "chunked") -> None:
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFFS)}, got {handoff!r}")
        self.spec = spec  # a TalkerSpec
        self.handoff = handoff
        self.streams: dict[str, object] = {}
        self.talker = EngineCore(config, _resolve(TALKER_EXECUTOR)(config, spec, self.streams, device, dtype))
        self.codec = spec.load_codec(device)
        # The thinker's dtype: rows are kept as they come.
        self.rows_dtype = rows_dtype
        self._rows_class = _resolve(TALKER_ROWS)
        self.answers: dict[str, SpokenAnswer] = {}

    @property
    def busy(self) -> bool:
        return bool(self.answers)

    def default_params(self, max_codes: int, seed: int | None = None) -> SamplingParams:
        """The checkpoint's own talker sampling, at most `max_codes` codes, seeded."""
        defaults = getattr(self.spec, "default_sampling", DEFAULT_TALKER_PARAMS)
        return self.talker_params(msgspec.structs.replace(defaults, max_tokens=max_codes, seed=seed))

    def talker_params(self, params: SamplingParams) -> SamplingParams:
        """`params` for the talker: its stop codes, the codes it never says (the spec's)."""
        return self.spec.talker_params(params)

    def check(self, speaker: str, prompt: TalkerPrompt, talker_params: SamplingParams) -> None:
        """Raises ValueError if `add` would be refused, or the talker could never take the answer."""
        if speaker not in self.spec.speakers:
            raise ValueError(f"unknown voice {speaker!r}; this model has {', '.join(sorted(self.spec.speakers))}")
        prompt.validate()
        prompt_ids = self.spec.prompt_token_ids(prompt.num_kept, speaker)
        positions = prompt.mrope_positions
        if positions is not None and positions.shape != (3, len(prompt_ids)):
            raise ValueError(f"talker prompt positions of shape {positions.shape} for a prompt of {len(prompt_ids)}")
        self.talker.check_request(Request("probe", prompt_ids, talker_params))

    def voice(self, name: str) -> str:
        """The model's speaker named `name`, whatever its case (transformers lowercases it)."""
        matches = [speaker for speaker in self.spec.speakers if speaker.casefold() == name.casefold()]
        return matches[0] if matches else name

    def add(self, request_id: str, prompt: TalkerPrompt, speaker: str, talker_params: SamplingParams) -> None:
        """Expect the rows of a checked answer; `talker_params` as `talker_params()` made them,
        `prompt` as the thinker's adapter made it (talker_prompt)."""
        rows = self._rows_class(num_prompt_rows=prompt.num_kept, pad=self.spec.text_pad,
                                mrope_positions=prompt.mrope_positions, mrope_delta=prompt.mrope_delta)
        self.answers[request_id] = SpokenAnswer(request_id, prompt, speaker, rows, talker_params,
                                                self.spec.prompt_token_ids(prompt.num_kept, speaker))

    def receive(self, request_id: str, start: int, rows: torch.Tensor | None, ended: bool = False,
                error: str | None = None) -> SpokenAnswer | None:
        """Takes the answer's thinker rows from position `start` on (see RowsChunk). An answer
        that is not to be spoken leaves the stage and is returned: its text failed (with its
        error), or ended before its prompt's rows were all in (an abort before its first token:
        nothing to say). Rows of an unknown answer (dropped, cancelled) are ignored."""
        answer = self.answers.get(request_id)
        if answer is None or answer.thinker_done:
            return None
        if error is not None:
            answer.error = error
            self.drop(request_id)
            return answer
        if rows is not None and rows.shape[0]:
            self._append(answer, start, rows)
        if ended and not answer.start_rows_in:
            self.drop(request_id)
            return answer
        if ended:
            answer.thinker_done = True
            answer.rows.finish(self.spec.text_eos.to(self.rows_dtype))
        self._start_or_feed(answer)
        return None

    def drop(self, request_id: str) -> None:
        """Forget an answer (failed, cancelled, or its caller gave up), its talker request too."""
        answer = self.answers.pop(request_id, None)
        if answer is not None and answer.talker_started:
            self.talker.abort_requests([request_id])
        self.streams.pop(request_id, None)

    def _append(self, answer: SpokenAnswer, start: int, rows: torch.Tensor) -> None:
        if start != answer.thinker_rows:
            # Positions the talker never reads are not sent: a gap may skip those only.
            if start < answer.thinker_rows or answer.prompt.reads_any(answer.thinker_rows, start):
                raise ValueError(f"rows of {answer.request_id} from position {start}; "
                                 f"{answer.thinker_rows} positions have arrived")
            answer.thinker_rows = start
        answer.thinker_rows += rows.shape[0]
        cut = answer.prompt.cut
        if start < cut:
            below = rows[:cut - start]
            kept = answer.prompt.kept_rows(start, below)
            if kept is not None:
                answer.rows.append(*kept)
            rows = rows[below.shape[0]:]
        if answer.thinker_rows >= cut and not answer.start_rows_in:
            # The talker's own start rows sit between the prompt's rows and the reply's.
            answer.rows.append(self.spec.start_rows(answer.speaker).to(rows.dtype))
            answer.start_rows_in = True
        if rows.shape[0]:
            answer.rows.append(rows)

    def _start_or_feed(self, answer: SpokenAnswer) -> None:
        known = answer.rows.known_positions
        if not answer.talker_started:
            if ((known is not None and known < len(answer.talker_prompt_ids))
                    or (self.handoff == "whole" and not answer.thinker_done)):
                return
            self.streams[answer.request_id] = answer.rows
            request = Request(answer.request_id, answer.talker_prompt_ids, answer.params, input_limit=known)
            self.talker.add_request(request)
            answer.talker_started = True
        else:
            self.talker.scheduler.set_input_limit(answer.request_id, known)

    def step(self) -> list[SpeechUpdate]:
        """One talker step: each answer's new codes; a finished answer leaves the stage, its
        codes without the end code (`waveform` makes its audio) or its error set."""
        updates = []
        for out in self.talker.step():
            answer = self.answers.get(out.request_id)
            if answer is None:
                continue
            if self.spec.num_code_groups > 1:
                # Frames, made beside each first code the talker said (never for its end code).
                new_codes = answer.rows.frames[len(answer.codes):]
            else:
                new_codes = list(out.new_token_ids)
            if out.finished:
                # The end code is not speech.
                while new_codes and new_codes[-1] in self.spec.stop_token_ids:
                    new_codes.pop()
            answer.codes.extend(new_codes)
            if out.finished:
                if out.error is not None:
                    answer.error = out.error
                self.streams.pop(answer.request_id, None)
                self.answers.pop(answer.request_id)
            updates.append(SpeechUpdate(answer, new_codes, out.finished))
        return updates

    def waveform(self, answer: SpokenAnswer) -> torch.Tensor:
        """A finished answer's whole waveform (empty if it ended before its first code), its
        codec noise drawn after its seed when it has one."""
        if not answer.codes:
            return torch.zeros(0)
        return self.codec.waveform(answer.codes, self.spec.speakers[answer.speaker], answer.params.seed)

    def codec_stream(self, answer: SpokenAnswer):
        """A stream that makes the answer's audio as its codes come: feed(new codes) -> chunks
        final now, finish() -> the rest."""
        return self.codec.stream(self.spec.speakers[answer.speaker], answer.params.seed)
