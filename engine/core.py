"""The engine core: one loop of schedule -> execute -> update.

It owns the scheduler, the KV cache manager and the model runner. It knows token ids
only; text and stop strings belong to the output processing in LLMEngine.
"""

from __future__ import annotations

from engine.config import EngineConfig, resolve_sizes
from engine.kv_cache_manager import KVCacheManager
from engine.protocol import EngineStatsSnapshot as EngineStats
from engine.request import Request, RequestStatus
from engine.scheduler import EngineCoreOutput, Scheduler


class EngineCore:
    def __init__(self, config: EngineConfig, model, model_config) -> None:
        from workers.model_runner import ModelRunner, kv_cache_shape

        self.config = config
        text_config = model_config.get_text_config()
        probe = kv_cache_shape(model_config, 1, config.block_size)
        dtype = next(model.parameters()).dtype
        self.sizes = resolve_sizes(
            config, model_max_len=text_config.max_position_embeddings, num_layers=probe.num_layers,
            num_kv_heads=probe.num_kv_heads, head_dim=probe.head_dim, dtype_bytes=dtype.itemsize)
        self.kv = KVCacheManager(self.sizes.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, self.sizes.max_model_len)
        self.runner = ModelRunner(model, kv_cache_shape(model_config, self.sizes.num_kv_blocks, config.block_size))

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.abort_requests(request_ids, status)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        return self.scheduler.update_from_output(sched, result)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_usable_blocks,
            prefix_cache_query_tokens=self.kv.stats.query_tokens,
            prefix_cache_hit_tokens=self.kv.stats.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
        )
