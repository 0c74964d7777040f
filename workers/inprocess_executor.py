"""The executor that runs the model in this process: loads it, then steps a ModelRunner.

Both the offline `LLM` and the decoder process drive their EngineCore through this class
(see engine/executor.py for the interface the core sees).
"""

from __future__ import annotations

import logging

import torch

from engine.adapters import adapter_for
from engine.checkpoint import load_tokenizer, resolve_model_path
from engine.grammars import GrammarCompiler
from engine.config import EngineConfig, global_encoder_cache_size
from engine.hidden_state_store import HiddenStateStore
from engine.executor import KVCacheSpec
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from workers.inprocess_encoder import InProcessEncoder
from workers import kv_cache_dtype
from workers.cpu import onednn_primitives
from workers.model_loader import load_model, resolve_device, resolve_dtype
from workers.gpu_memory import profile_kv_cache_bytes
from workers.model_runner import KVCacheShape, ModelRunner
from workers.paged_attention import resolve_attention_backend

logger = logging.getLogger("antiphon")


class InProcessExecutor:
    """`with_encoder`: also load the vision tower here (the offline LLM); the decoder
    process leaves it to the encoder process."""

    def __init__(self, config: EngineConfig, with_encoder: bool = True) -> None:
        from transformers import AutoConfig

        self.config = config
        path = self.path = resolve_model_path(config.model)
        model_config = AutoConfig.from_pretrained(path)
        self.model_max_len = model_config.get_text_config().max_position_embeddings
        device = resolve_device(config.device)
        if device.type == "cpu":
            # Before the weights are packed: the caches take their capacity then.
            onednn_primitives.bound_primitive_caches()
        dtype = resolve_dtype(config.dtype, model_config, device)
        served_len = config.max_model_len if config.max_model_len is not None else self.model_max_len
        self.attention_backend = resolve_attention_backend(config.attention_backend, device)
        # Before the weights load: the model's dtype is known already.
        self.kv_cache_dtype = kv_cache_dtype.resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device,
                                                                    self.attention_backend)
        self.adapter = adapter_for(path, model_config)
        self.model = load_model(path, model_config, dtype, device, served_len, self.adapter, config.quantization)
        self.max_embeddings_per_item = self.adapter.max_embeddings_per_item() if self.adapter else 0
        self.embedding_source = None
        if self.adapter is not None and with_encoder:
            self.embedding_source = InProcessEncoder(self.adapter, dtype, device, global_encoder_cache_size(
                config, self.max_embeddings_per_item, self.adapter.embedding_size() * dtype.itemsize))
        self.kv_cache_spec = kv_cache_spec(model_config, self.kv_cache_dtype)
        logger.info("KV cache holds %s (--kv-cache-dtype %s)", kv_cache_dtype.name(self.kv_cache_dtype),
                    config.kv_cache_dtype)
        self.model_config = model_config
        self.model_dtype = dtype
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.device = device
        self.is_accelerated = device.type == "cuda"
        self.grammars = GrammarCompiler(lambda: load_tokenizer(path), self.vocab_size)
        self.runner: ModelRunner | None = None

    def measure_kv_cache_bytes(self) -> int | None:
        if self.device.type != "cuda":
            return None
        config = self.config
        free = profile_kv_cache_bytes(
            lambda num_blocks: self._runner(num_blocks, config.block_size, grammars=None),
            self.kv_cache_spec, config.block_size, config.max_num_batched_tokens, config.max_num_seqs,
            config.gpu_memory_utilization, self.device)
        if self.adapter is None:
            return free
        # The encoder's global cache fills after start, on the same device: leave it room.
        bytes_per_embedding = self.adapter.embedding_size() * self.model_dtype.itemsize
        encoder_cache = global_encoder_cache_size(config, self.max_embeddings_per_item, bytes_per_embedding)
        left = free - encoder_cache * bytes_per_embedding
        if left < 2 * self.kv_cache_spec.bytes_per_block(config.block_size):
            raise RuntimeError(f"the encoder cache ({encoder_cache * bytes_per_embedding / (1 << 30):.2f} GiB, "
                               "--encoder-cache-gib) leaves no GPU memory for the KV cache; lower it or raise "
                               "--gpu-memory-utilization")
        return left

    def initialize_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.runner = self._runner(num_blocks, block_size, self.grammars, self._decode_graphs(), max_model_len)
        self.runner.capture_graphs()

    def _decode_graphs(self) -> str:
        """The runner's graph mode: "auto" captures where graphs can run (CUDA, Triton
        attention, a text model) and runs eagerly elsewhere."""
        mode = self.config.decode_graphs
        if mode == "auto":
            usable = self.device.type == "cuda" and self.attention_backend == "triton" and self.adapter is None
            if usable and "dynamic" in _rope_type(self.model_config):
                # Dynamic RoPE scaling compares the longest position with a cached length on
                # the host in every forward: that cannot be captured.
                logger.info("CUDA graphs off: dynamic RoPE scaling reads positions on the host")
                usable = False
            return "capture" if usable else "off"
        return mode

    def _runner(self, num_blocks: int, block_size: int, grammars, decode_graphs: str = "off",
                max_model_len: int | None = None) -> ModelRunner:
        spec = self.kv_cache_spec
        width = self.adapter.talker_row_width() if self.adapter is not None and self.config.omni_speech else None
        # An omni thinker's rows for its talker, in the KV pool's layout (seed 002).
        limit = self.config.hidden_state_store_gib
        hidden_store = None if width is None else HiddenStateStore(
            num_blocks, block_size, width, self.model_dtype, max_bytes=None if limit is None else int(limit * 2**30))
        return ModelRunner(self.model, KVCacheShape(spec.num_layers, num_blocks, block_size, spec.num_kv_heads,
                                                    spec.head_dim, self.kv_cache_dtype), self.adapter, grammars,
                           hidden_store=hidden_store,
                           attention_backend=self.attention_backend, decode_graphs=decode_graphs,
                           # No decode batch is larger than either of the scheduler's limits.
                           max_graph_batch_size=min(self.config.max_graph_batch_size, self.config.max_num_seqs,
                                                    self.config.max_num_batched_tokens),
                           max_model_len=max_model_len)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def close(self) -> None:
        if self.runner is not None and self.runner.structured is not None:
            self.runner.structured.close()
        self.grammars.close()
        self.runner = None


def _rope_type(model_config) -> str:
    text = model_config.get_text_config()
    parameters = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return str(parameters.get("rope_type", parameters.get("type", "default")))


def kv_cache_spec(model_config, dtype: torch.dtype) -> KVCacheSpec:
    text = model_config.get_text_config()
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    return KVCacheSpec(text.num_hidden_layers, num_kv_heads, head_dim, dtype.itemsize)
