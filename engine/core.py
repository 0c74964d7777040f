"""The engine core: one loop of schedule -> execute -> update.

It owns the scheduler and the KV cache manager, and drives the model through an executor
(engine/executor.py) it is given: it never knows where or how the model runs. It knows
token ids only; text and stop strings belong to the output processing.

With async_scheduling the executor runs in a worker thread and the next step is scheduled
while the current one runs: the scheduler hands the runner placeholders for tokens not
sampled yet, and the runner, executing steps in order, fills them in. Outputs are the same
as without; a request that finishes in step N may have computed one wasted token in N+1.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from engine.config import EngineConfig, resolve_sizes
from engine.executor import Executor
from engine.kv_cache_manager import KVCacheManager
from engine.protocol import EngineStatsSnapshot as EngineStats
from engine.request import Request, RequestStatus
from engine.scheduler import EngineCoreOutput, Scheduler


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.sizes = resolve_sizes(config, executor.model_max_len, executor.kv_cache_spec)
        executor.initialize_kv_cache(self.sizes.num_kv_blocks, config.block_size)
        self.kv = KVCacheManager(self.sizes.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, self.sizes.max_model_len)
        use_async = config.async_scheduling
        if use_async is None:
            use_async = executor.is_accelerated
        self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="model-runner") if use_async else None
        # The step the executor is running now: (what was scheduled, its future result).
        self._in_flight: tuple | None = None

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.abort_requests(request_ids, status)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        if self._step_thread is not None:
            return self._step_pipelined()
        sched = self.scheduler.schedule()
        result = self.executor.execute(sched)
        return self.scheduler.update_from_output(sched, result)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            self._in_flight = self._submit(self.scheduler.schedule())
        sched, future = self._in_flight
        # Schedule the next step while this one runs.
        upcoming = self.scheduler.schedule() if self.scheduler.has_unfinished_requests else None
        outputs = self.scheduler.update_from_output(sched, future.result())
        self._in_flight = self._submit(upcoming) if upcoming is not None else None
        return outputs

    def _submit(self, sched) -> tuple:
        future: Future = self._step_thread.submit(self.executor.execute, sched)
        return sched, future

    def close(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        self.executor.close()

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
