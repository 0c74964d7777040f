"""The seam between the engine core and whatever runs the model.

The core schedules and keeps the KV books; an executor runs the steps: it takes a
SchedulerOutput and returns a ModelRunnerOutput. Before the first step it tells the core
what one token of KV costs and how long the model's context is, so the core can size the
block pool, and then allocates the pool it is given. The in-process executor (model and
runner in this process) lives in workers/; the engine imports no executor, only this
interface, so the offline API and the decoder process build the same core around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class KVCacheSpec:
    """What the core needs to size the KV pool; per token of one layer: keys and values of
    num_kv_heads heads of head_dim elements of dtype_bytes each."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    def bytes_per_block(self, block_size: int) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes


class EmbeddingSource(Protocol):
    """The encoder, as the engine core sees it: it registers each request's raw items, is
    asked for embeddings by mm_hash, and delivers them (or an error) when they are ready."""

    def register(self, request_id: str, items: list) -> None:
        """Keep the request's preprocessed items until `release`, so any of them can be
        encoded (again, after an eviction) whenever asked."""

    def release(self, request_id: str) -> None:
        """The request ended: its items may go."""

    def request(self, mm_hashes: list[str]) -> None:
        """Start making these items' embeddings."""

    def poll(self) -> list[tuple[str, object, str | None]]:
        """Deliveries since the last poll: (mm_hash, embeddings or None, error or None)."""


class Executor(Protocol):
    kv_cache_spec: KVCacheSpec
    # The model's own context length (max_position_embeddings of its text part).
    model_max_len: int
    # Rows of the input embedding: token ids at or above it are not tokens of this model.
    vocab_size: int
    # True when steps run on an accelerator, where scheduling the next step while this one
    # runs pays off (EngineConfig.async_scheduling=None follows it).
    is_accelerated: bool
    # The most embeddings one image or audio item can make; 0 for a text-only model.
    max_embeddings_per_item: int
    # Where item embeddings come from when the encoder runs in this process (the offline
    # LLM); None when another process delivers them (the decoder process) or for text.
    embedding_source: "EmbeddingSource | None"
    # Structured output: an engine.grammars.GrammarCompiler the core submits specs to (the
    # runner builds its matchers from the same compiles), or None without a grammar engine.
    grammars: object | None

    def measure_kv_cache_bytes(self) -> int | None:
        """Bytes the device can give the KV pool, measured (None: no measure here, a CPU)."""

    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """Allocate the KV pool (and capture what runs on it); called once, before the first step."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Steps run in the order they are given, one at a time."""

    def close(self) -> None:
        """Release what the executor holds; no step runs after this."""
