"""Engine configuration: one dataclass, with derived sizes resolved in one place."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from engine.executor import KVCacheSpec

# How a CPU may serve the linear layers (workers/cpu/linear_modes.py).
QUANTIZATION_MODES = ("none", "bf16", "int8", "int4")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
DECODE_GRAPH_MODES = ("auto", "off", "padded-eager")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# What the KV cache may hold (workers/kv_cache_dtype.py).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
# The KV pool on a CPU when kv_cache_memory_gib is not set.
CPU_KV_CACHE_GIB = 2.0

logger = logging.getLogger("antiphon")

GIB = 1 << 30


@dataclass
class EngineConfig:
    # None serves the embedded default model (SmolLM2-135M-Instruct).
    model: str | None = None
    # "auto" runs float32 on CPU (exact and fast enough there) and the checkpoint's own
    # dtype on CUDA.
    dtype: str = "auto"
    device: str = "auto"

    block_size: int = 16
    # None sizes the pool from kv_cache_memory_gib.
    num_kv_blocks: int | None = None
    # None: 2 GiB on a CPU; on CUDA what is left of gpu_memory_utilization of the device
    # after the weights and a profiling step at the full token budget (workers/gpu_memory.py).
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    # How attention reads the paged cache (workers/paged_attention.py): "auto" is the Triton
    # kernels on CUDA and torch on a CPU; "triton" on a CPU runs them in Triton's interpreter.
    attention_backend: str = "auto"
    # CUDA graphs of pure-decode steps (workers/decode_graphs.py), one per batch size up to
    # max_graph_batch_size: "auto" captures them on CUDA with the Triton backend; "off" runs
    # eagerly (vLLM's enforce_eager); "padded-eager" runs the graphs' padded static buffers
    # without capturing, which a CPU can test and which tells a capture bug from a padding one.
    decode_graphs: str = "auto"
    max_graph_batch_size: int = 256
    enable_prefix_caching: bool = True
    # The KV cache's element type (workers/kv_cache_dtype.py): "auto" is the model's dtype;
    # "bfloat16" halves a float32 CPU model's cache (approximate: keys and values are rounded).
    # A dtype other than the model's is served on CPU only.
    kv_cache_dtype: str = "auto"

    # Token budget of one step, shared by decodes and prefill chunks.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # None takes the model's own context length.
    max_model_len: int | None = None
    # Schedule step N+1 while step N runs (model in a worker thread); same outputs. None is
    # auto: on for CUDA, where CPU scheduling hides behind GPU work; off on CPU, where the
    # scheduler and the model share the same cores and the overlap measured as a loss.
    async_scheduling: bool | None = None
    # A step that schedules nothing while requests wait counts as a stall; after this many
    # in a row the head-of-line request fails with an error instead of spinning forever.
    max_stalled_steps: int = 8
    # Embeddings (image or audio items) the decoder may hold or wait for at once. None
    # derives it from the model and the token budget (resolve_sizes); 0 turns items off.
    encoder_cache_size: int | None = None
    # A request whose item the encoder has not delivered after this long fails.
    encoder_timeout_s: float = 60.0
    # A request whose grammar (structured output) has not compiled after this long fails.
    grammar_timeout_s: float = 30.0
    # The global cross-request encoder cache (off: every ask of the decoder runs the tower;
    # for measuring what the cache saves).
    enable_encoder_cache: bool = True
    # Memory of that global cache. It is sized apart from the decoder's budget above: that
    # one bounds what a step may hold, this one how many distinct images stay encoded.
    encoder_cache_gib: float = 1.0
    # An omni model's spoken answers (offline: LLM.generate(voice=...)): the thinker keeps the
    # rows its talker consumes in a hidden-state store (engine/hidden_state_store.py: one row of
    # the thinker's width per KV slot, in host memory: about an eighth of the KV pool's bytes for
    # Qwen2.5-Omni-7B). hidden_state_store_gib bounds it (None: what the pool needs; a pool that
    # needs more than the bound is refused at start). Off, an omni model serves text and costs
    # nothing more.
    # The server turns it on for an omni model with voice on (its talker process speaks).
    omni_speech: bool = False
    hidden_state_store_gib: float | None = None
    # The most codec tokens one spoken answer may take (Qwen2.5-Omni says 50 a second: 82 s of
    # speech; Qwen3-Omni 12.5 frames a second), so a talker that never says its end code stops.
    max_spoken_codes: int = 4096
    # CPU threads of the omni talker process's torch (None: a quarter of the cores, at least
    # one). torch's default, a thread per core, would add as many spinning threads as the
    # decoder's own pool (which keeps torch's default) on the same cores.
    talker_threads: int | None = None
    # CPU threads of the decoder's torch (None: torch's default, a thread per core). Data
    # parallel replicas on one machine split the cores between them.
    decoder_threads: int | None = None
    # The decoder tells the front end which KV blocks its prefix cache indexes and evicts, with
    # every step's outputs (for the data-parallel router; set by the server, not a flag).
    publish_cache_events: bool = False
    # How a CPU serves the linear layers (workers/cpu/linear_modes.py): "none" is exact, "bf16" and
    # "int8" read fewer bytes; "auto" picks the fastest mode within the quality bound. The
    # ANTIPHON_QUANTIZATION variable sets the default (the test suite sets "none").
    quantization: str = dataclasses.field(default_factory=lambda: os.environ.get("ANTIPHON_QUANTIZATION", "auto"))
    # Voice, when served: speech recognition in the encoder process, synthesis in the talker.
    # The models: a Whisper folder (None: the packaged tiny.en) and a Piper .onnx voice
    # (None: the packaged "joe" voice).
    voice: bool = False
    asr_model: str | None = None
    tts_voice: str | None = None

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_stalled_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (one is reserved), got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.encoder_cache_size is not None and self.encoder_cache_size < 0:
            raise ValueError(f"encoder_cache_size must be >= 0, got {self.encoder_cache_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.decode_graphs == "padded-eager" and self.attention_backend == "torch":
            raise ValueError("decode_graphs='padded-eager' runs the triton attention backend, not torch")
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise ValueError(f"decode_graphs must be one of {', '.join(DECODE_GRAPH_MODES)}, got {self.decode_graphs!r}")
        if self.max_graph_batch_size < 1:
            raise ValueError(f"max_graph_batch_size must be >= 1, got {self.max_graph_batch_size}")
        if self.quantization not in ("auto", *QUANTIZATION_MODES):
            raise ValueError(f"quantization must be auto or one of {', '.join(QUANTIZATION_MODES)}, "
                             f"got {self.quantization!r}")
        if not self.encoder_cache_gib >= 0:
            raise ValueError(f"encoder_cache_gib must be >= 0, got {self.encoder_cache_gib}")
        if self.hidden_state_store_gib is not None and not self.hidden_state_store_gib > 0:
            raise ValueError(f"hidden_state_store_gib must be > 0, got {self.hidden_state_store_gib}")
        if self.max_spoken_codes < 1:
            raise ValueError(f"max_spoken_codes must be >= 1, got {self.max_spoken_codes}")
        for name in ("talker_threads", "decoder_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.omni_speech:
            if self.async_scheduling:
                raise ValueError("omni_speech reads the thinker's rows between steps: async_scheduling must be off")
            # Its automatic choice (on with CUDA) would overlap the steps.
            self.async_scheduling = False
        if not self.grammar_timeout_s > 0:
            raise ValueError(f"grammar_timeout_s must be > 0, got {self.grammar_timeout_s}")
        if not self.encoder_timeout_s > 0:
            raise ValueError(f"encoder_timeout_s must be > 0, got {self.encoder_timeout_s}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine config option(s): {', '.join(unknown)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class ResolvedSizes:
    """Sizes that depend on the loaded model; computed once by `resolve_sizes`."""

    max_model_len: int
    num_kv_blocks: int
    # Embeddings the decoder may hold at once (0: the model takes no items).
    encoder_budget: int = 0


def encoder_budget(config: EngineConfig, max_embeddings_per_item: int) -> int:
    """Room for what one step can consume (a full token budget of item embeddings, or the
    largest item if bigger) plus one more largest item: two identical requests in one step
    whose shared prefix ends in a recomputed block inside an item need that item again while
    the first one's is still held (vLLM seed 003)."""
    if not max_embeddings_per_item:
        return 0
    if config.encoder_cache_size is not None:
        return config.encoder_cache_size
    return max(config.max_num_batched_tokens, max_embeddings_per_item) + max_embeddings_per_item


def global_encoder_cache_size(config: EngineConfig, max_embeddings_per_item: int,
                              bytes_per_embedding: int) -> int:
    """Embeddings the encoder's global cache may keep: encoder_cache_gib of them, never fewer
    than the decoder's budget (what the decoder may ask for at once should fit), nothing
    when the cache is turned off."""
    if not config.enable_encoder_cache or not max_embeddings_per_item:
        return 0
    by_memory = int(config.encoder_cache_gib * GIB) // max(1, bytes_per_embedding)
    return max(by_memory, encoder_budget(config, max_embeddings_per_item))


def resolve_sizes(config: EngineConfig, model_max_len: int, kv_cache_spec: KVCacheSpec,
                  max_embeddings_per_item: int = 0, measured_kv_bytes: int | None = None) -> ResolvedSizes:
    """`measured_kv_bytes`: what the device has left for the KV pool (CUDA), when
    kv_cache_memory_gib does not say."""
    max_model_len = model_max_len if config.max_model_len is None else config.max_model_len
    if max_model_len > model_max_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {model_max_len}")
    bytes_per_block = kv_cache_spec.bytes_per_block(config.block_size)
    if config.num_kv_blocks is not None:
        num_blocks, source = config.num_kv_blocks, "num_kv_blocks"
    else:
        # Never more than the scheduler could ever fill (+1 for the reserved block): small
        # models would otherwise take the whole memory budget for nothing.
        most_usable = config.max_num_seqs * -(-max_model_len // config.block_size) + 1
        if config.kv_cache_memory_gib is not None:
            budget, source = int(config.kv_cache_memory_gib * GIB), "kv_cache_memory_gib"
        elif measured_kv_bytes is not None:
            budget = measured_kv_bytes
            source = f"{budget / GIB:.2f} GiB free at gpu_memory_utilization {config.gpu_memory_utilization}"
        else:
            budget, source = int(CPU_KV_CACHE_GIB * GIB), f"{CPU_KV_CACHE_GIB:g} GiB CPU default"
        num_blocks = max(2, min(budget // bytes_per_block, most_usable))
        if num_blocks == most_usable:
            source += ", capped at what max_num_seqs x max_model_len can fill"
    sizes = ResolvedSizes(max_model_len, num_blocks, encoder_budget(config, max_embeddings_per_item))
    logger.info(
        "KV cache: %d blocks x %d tokens (%.1f MiB), max_model_len=%d, token budget %d, max %d seqs, "
        "prefix caching %s (sized by %s)",
        num_blocks, config.block_size, num_blocks * bytes_per_block / (1 << 20), max_model_len,
        config.max_num_batched_tokens, config.max_num_seqs,
        "on" if config.enable_prefix_caching else "off", source,
    )
    if sizes.encoder_budget:
        logger.info("Encoder cache budget: %d embeddings (largest item %d)%s", sizes.encoder_budget,
                    max_embeddings_per_item, "" if config.encoder_cache_size is None else ", set by encoder_cache_size")
    return sizes
