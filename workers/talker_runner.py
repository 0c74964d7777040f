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


@dataclass
class TalkerRows:
    """One answer's input rows, at the thinker's width, in talker positions: the thinker's
    prompt rows, the speaker's text-bos embedding, then a row per generated thinker token as
    it comes. `finish(eos)` ends the stream: its text-eos row, then `pad` for ever after.
    Rows are kept in one buffer that grows by a quarter when full (appends cost their own rows
    only, amortized; at most a quarter of the buffer unused)."""

    num_prompt_rows: int
    pad: torch.Tensor
    # 3-D M-RoPE positions of the talker's prompt (the thinker's, plus two text positions) and
    # the delta of later positions; None: text positions on all three axes.
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    num_rows: int = 0
    finished: bool = False
    _buffer: torch.Tensor | None = field(default=None, repr=False)

    def append(self, rows: torch.Tensor) -> None:
        if self.finished:
            raise RuntimeError("rows after the end of the stream")
        needed = self.num_rows + rows.shape[0]
        if self._buffer is None or needed > self._buffer.shape[0]:
            # A quarter more each time: the prompt's rows come at once, then a row per token.
            grown = torch.empty(max(needed, self.num_rows + self.num_rows // 4, 64), rows.shape[1], dtype=rows.dtype)
            if self._buffer is not None:
                grown[:self.num_rows] = self._buffer[:self.num_rows]
            self._buffer = grown
        self._buffer[self.num_rows:needed] = rows
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
        """Codec embeddings (none over the thinker's prompt) plus each position's row."""
        embeds = self.embed_tokens(input_ids)
        for state, start, end, q0 in zip(states, batch.starts.tolist(), batch.ends.tolist(),
                                         batch.query_offsets.tolist()):
            stream = state.input_rows
            rows = stream.rows(start, end).to(embeds.device, embeds.dtype)
            codec = embeds[0, q0:q0 + end - start]
            prompt_part = max(0, min(end, stream.num_prompt_rows) - start)
            codec[:prompt_part] = 0
            embeds[0, q0:q0 + end - start] = codec + rows
        return embeds, torch.zeros(embeds.shape[1], dtype=torch.bool, device=embeds.device)


class TalkerExecutor:
    """The Executor the talker's engine core drives (engine/executor.py): the talker model of
    an omni checkpoint, in this process."""

    def __init__(self, config: EngineConfig, spec, streams: dict[str, TalkerRows], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.model = spec.load_talker(dtype, device, ATTENTION_NAME)
        talker = self.model.config.talker_config
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
        self.runner = TalkerRunner(self.model, KVCacheShape(spec.num_layers, num_blocks, block_size,
                                                            spec.num_kv_heads, spec.head_dim, self.dtype),
                                   self.streams)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def close(self) -> None:
        self.runner = None
