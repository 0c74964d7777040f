"""The talker stage's model runner and executor: an omni talker batched like any model.

The talker is a second autoregressive stage with its own engine core (scheduler, paged KV,
continuous batching). Its input at each position is a row of the thinker's (TalkerRows, fed
as the thinker makes them) plus, from the end of its prompt on, the embedding of a codec
token (engine/adapters/qwen2_5_omni_talker.py). The scheduler does not schedule a position
whose row has not arrived (Request.input_limit); the runner reads each step's rows from the
request's TalkerRows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig
from engine.executor import KVCacheSpec
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from workers.batch_planning import PackedBatch, RunnerRequest
from workers.model_runner import KVCacheShape, ModelRunner
from workers.paged_attention import ATTENTION_NAME
from workers.sampler import filter_top_k_top_p


@dataclass
class TalkerRows:
    """One answer's input rows, at the thinker's width, in talker positions: the thinker's
    kept prompt rows, the talker's start rows, then a row per generated thinker token as it
    comes. `finish(eos)` ends the stream: its text-eos row, then `pad` for ever after.
    Rows are kept in one buffer that grows by a quarter when full (appends cost their own rows
    only, amortized; at most a quarter of the buffer unused), with a flag per row: whether it
    is an item's (the thinker's reading of an image or clip). A talker with code groups also
    keeps here each frame it said (`frames`)."""

    num_prompt_rows: int
    pad: torch.Tensor
    # 3-D M-RoPE positions of the talker's prompt and the delta of later positions; None:
    # text positions on all three axes.
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    num_rows: int = 0
    finished: bool = False
    frames: list[list[int]] = field(default_factory=list)
    # The code predictor's random draws when the talker samples (seeded as the request is).
    generator: torch.Generator | None = field(default=None, repr=False)
    _buffer: torch.Tensor | None = field(default=None, repr=False)
    _from_items: torch.Tensor | None = field(default=None, repr=False)

    def append(self, rows: torch.Tensor, from_items: torch.Tensor | None = None) -> None:
        if self.finished:
            raise RuntimeError("rows after the end of the stream")
        needed = self.num_rows + rows.shape[0]
        if self._buffer is None or needed > self._buffer.shape[0]:
            # A quarter more each time: the prompt's rows come at once, then a row per token.
            size = max(needed, self.num_rows + self.num_rows // 4, 64)
            grown = torch.empty(size, rows.shape[1], dtype=rows.dtype)
            grown_items = torch.zeros(size, dtype=torch.bool)
            if self._buffer is not None:
                grown[:self.num_rows] = self._buffer[:self.num_rows]
                grown_items[:self.num_rows] = self._from_items[:self.num_rows]
            self._buffer, self._from_items = grown, grown_items
        self._buffer[self.num_rows:needed] = rows
        self._from_items[self.num_rows:needed] = False if from_items is None else from_items
        self.num_rows = needed

    def finish(self, eos: torch.Tensor) -> None:
        self.append(eos.unsqueeze(0))
        self.finished = True

    @property
    def known_positions(self) -> int | None:
        """How many positions have their row; None once every later one is `pad`."""
        return None if self.finished else self.num_rows

    def rows(self, start: int, end: int) -> torch.Tensor:
        stored = self._buffer[start:min(end, self.num_rows)]
        if end <= self.num_rows:
            return stored
        if not self.finished:
            raise RuntimeError(f"rows up to {end} asked for; {self.num_rows} have arrived")
        return torch.cat([stored, self.pad.to(stored.dtype).expand(end - max(start, self.num_rows), -1)])

    def from_items(self, start: int, end: int) -> torch.Tensor:
        flags = self._from_items[start:min(end, self.num_rows)]
        return torch.cat([flags, flags.new_zeros(end - max(start, self.num_rows))]) if end > self.num_rows else flags


class _TalkerPositions:
    """What the base runner asks of an adapter: the talker's positions are M-RoPE (set per
    request from its TalkerRows), and it keeps no hidden-state store."""

    uses_mrope = True

    def talker_row_width(self) -> None:
        return None


class TalkerRunner(ModelRunner):
    def __init__(self, model: torch.nn.Module, cache_shape: KVCacheShape, streams: dict[str, TalkerRows]) -> None:
        super().__init__(model, cache_shape, _TalkerPositions())
        self.streams = streams

    def _update_states(self, sched: SchedulerOutput) -> None:
        super()._update_states(sched)
        for new in sched.new_requests:
            stream = self.streams[new.request_id]
            state = self.requests[new.request_id]
            state.input_rows = stream
            state.mrope_positions, state.mrope_delta = stream.mrope_positions, stream.mrope_delta

    def _input_embeddings(self, input_ids: torch.Tensor, states: list[RunnerRequest],
                          batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Codec embeddings (none over the thinker's prompt rows) plus each position's row, as
        the talker takes it (`rows_input`, once for the step's rows)."""
        embeds = self.embed_tokens(input_ids)
        codec = embeds[0]
        rows, flags = [], []
        for state, start, end, q0 in zip(states, batch.starts.tolist(), batch.ends.tolist(),
                                         batch.query_offsets.tolist()):
            stream = state.input_rows
            prompt_part = max(0, min(end, stream.num_prompt_rows) - start)
            codec[q0:q0 + prompt_part] = 0
            rows.append(stream.rows(start, end))
            flags.append(stream.from_items(start, end))
        self._generated_codec_rows(states, batch, codec)
        order = torch.cat([torch.arange(q0, q0 + end - start) for start, end, q0 in
                           zip(batch.starts.tolist(), batch.ends.tolist(), batch.query_offsets.tolist())])
        flags = torch.cat(flags)
        projected = self.model.rows_input(torch.cat(rows).to(embeds.device),
                                          flags.to(embeds.device) if bool(flags.any()) else None)
        codec[order.to(embeds.device)] += projected.to(embeds.dtype)
        return embeds, torch.zeros(embeds.shape[1], dtype=torch.bool, device=embeds.device)

    def _generated_codec_rows(self, states: list[RunnerRequest], batch: PackedBatch, codec: torch.Tensor) -> None:
        """A talker with code groups: positions after the prompt take their frame's input row."""


class CodeGroupTalkerRunner(TalkerRunner):
    """A talker that says a frame of codes a step (Qwen3-Omni): after each step its code
    predictor says the rest of every new frame, from the talker's hidden state and the first
    code just sampled, and keeps the frame in the request's TalkerRows; the frame's codes,
    embedded and summed, are the talker's input at the next position. Kept there, a preempted
    request recomputes without the predictor."""

    def _forward(self, batch: PackedBatch, states: list[RunnerRequest]) -> torch.Tensor:
        logits = super()._forward(batch, states)
        self._sampling_states = [states[i] for i in batch.sample_rows]
        return logits

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._sampling_states = []
        output = super()._execute(sched)
        rows = [i for i, state in enumerate(self._sampling_states) if self._says_a_frame(state)]
        if not rows:
            return output
        states = [self._sampling_states[i] for i in rows]
        hidden = self.model.kept_hidden[rows]
        first = torch.tensor([state.token_ids[-1] for state in states], device=hidden.device)
        with torch.inference_mode():
            codes = self.model.predict_frames(hidden, first, PredictorSampling(states, self.model.num_code_groups,
                                                                              hidden.device))
        for state, code0, rest in zip(states, first.tolist(), codes.tolist()):
            state.input_rows.frames.append([code0, *rest])
        return output

    @staticmethod
    def _says_a_frame(state: RunnerRequest) -> bool:
        """Whether the code just sampled starts a frame. Not the end code; nor the last code a
        code budget allows: generate predicts a frame's other codes when its first code is fed
        back, which never happens to that one (its frame is not said: same codes as generate)."""
        said = len(state.token_ids) - state.num_prompt_tokens
        return (said > len(state.input_rows.frames) and said < state.sampling_params.max_tokens
                and state.token_ids[-1] not in state.sampling_params.stop_token_ids)

    def _generated_codec_rows(self, states: list[RunnerRequest], batch: PackedBatch, codec: torch.Tensor) -> None:
        frames, places = [], []
        for state, start, end, q0 in zip(states, batch.starts.tolist(), batch.ends.tolist(),
                                         batch.query_offsets.tolist()):
            first = max(start, state.num_prompt_tokens)
            if first < end:
                j = first - state.num_prompt_tokens
                frames += state.input_rows.frames[j:j + end - first]
                places += range(q0 + first - start, q0 + end - start)
        if frames:
            rows = self.model.frame_rows(torch.tensor(frames, device=codec.device))
            codec[torch.tensor(places, device=codec.device)] = rows.to(codec.dtype)


class PredictorSampling:
    """The code predictor's picks for one step's frames: greedy for a greedy talker, else
    sampled as generate samples them (top-k 50, top-p 0.8, temperature 1), each answer's draws
    from its own generator (seeded as its request is), drawn up front so that picking needs no
    sync with the device."""

    def __init__(self, states: list[RunnerRequest], num_code_groups: int, device: torch.device) -> None:
        self.sampled = [i for i, state in enumerate(states) if not state.sampling_params.greedy]
        self.uniforms = None
        if self.sampled:
            draws = []
            for i in self.sampled:
                stream, params = states[i].input_rows, states[i].sampling_params
                if stream.generator is None:
                    stream.generator = torch.Generator()
                    if params.seed is not None:
                        stream.generator.manual_seed(params.seed)
                    else:
                        stream.generator.seed()
                draws.append(torch.rand(num_code_groups - 1, generator=stream.generator))
            self.uniforms = torch.stack(draws).to(device)
            self.rows = torch.tensor(self.sampled, device=device)

    def __call__(self, group: int, logits: torch.Tensor) -> torch.Tensor:
        from engine.adapters.qwen3_omni_talker import PREDICTOR_TOP_K, PREDICTOR_TOP_P

        picks = logits.argmax(-1)
        if self.uniforms is None:
            return picks
        rows = len(self.sampled)
        filtered = filter_top_k_top_p(logits[self.rows], [PREDICTOR_TOP_K] * rows, [PREDICTOR_TOP_P] * rows)
        cdf = filtered.softmax(-1).cumsum(-1)
        # Inverse CDF: the first code whose cumulative mass exceeds the draw.
        drawn = (cdf <= self.uniforms[:, group:group + 1] * cdf[:, -1:]).sum(-1).clamp_(max=logits.shape[-1] - 1)
        # A device's parallel cumsum may round a step down: never a code the filter removed.
        removed = filtered.gather(-1, drawn.unsqueeze(-1)).squeeze(-1).isinf()
        picks[self.rows] = torch.where(removed, filtered.argmax(-1), drawn)
        return picks


class TalkerExecutor:
    """The Executor the talker's engine core drives (engine/executor.py): the talker model of
    an omni checkpoint, in this process."""

    def __init__(self, config: EngineConfig, spec, streams: dict[str, TalkerRows], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.model = spec.load_talker(dtype, device, ATTENTION_NAME)
        talker = self.model.config.talker_config
        # Qwen3-Omni's talker keeps its decoder's sizes in a text config; Qwen2.5's at the top.
        talker = getattr(talker, "text_config", talker)
        self.model_max_len = talker.max_position_embeddings
        self.vocab_size = talker.vocab_size
        self.is_accelerated = device.type == "cuda"
        self.max_embeddings_per_item = 0
        self.embedding_source = None
        self.grammars = None
        self.dtype = dtype
        head_dim = getattr(talker, "head_dim", None) or talker.hidden_size // talker.num_attention_heads
        self.kv_cache_spec = KVCacheSpec(talker.num_hidden_layers, talker.num_key_value_heads, head_dim,
                                         dtype.itemsize)
        self.streams = streams
        self.runner: TalkerRunner | None = None

    def measure_kv_cache_bytes(self) -> int | None:
        return None

    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        spec = self.kv_cache_spec
        runner_class = CodeGroupTalkerRunner if getattr(self.model, "num_code_groups", 1) > 1 else TalkerRunner
        self.runner = runner_class(self.model, KVCacheShape(spec.num_layers, num_blocks, block_size,
                                                            spec.num_kv_heads, spec.head_dim, self.dtype),
                                   self.streams)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def close(self) -> None:
        self.runner = None
