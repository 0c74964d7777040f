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

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from engine.config import EngineConfig, resolve_sizes
from engine.executor import EmbeddingSource, Executor
from engine.kv_cache_manager import KVCacheManager
from engine.protocol import EngineStatsSnapshot as EngineStats
from engine.request import Request, RequestStatus
from engine.scheduler import EngineCoreOutput, Scheduler


# How long an empty step waits for a grammar that is compiling.
GRAMMAR_WAIT_S = 0.002


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor,
                 embedding_source: EmbeddingSource | None = None) -> None:
        self.config = config
        self.executor = executor
        measured = None
        if config.num_kv_blocks is None and config.kv_cache_memory_gib is None:
            measured = executor.measure_kv_cache_bytes()
        self.sizes = resolve_sizes(config, executor.model_max_len, executor.kv_cache_spec,
                                   executor.max_embeddings_per_item, measured)
        executor.initialize_kv_cache(self.sizes.num_kv_blocks, config.block_size, self.sizes.max_model_len)
        self.kv = KVCacheManager(self.sizes.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, self.sizes.max_model_len, self.sizes.encoder_budget)
        # The encoder: in this process for the offline LLM, or another process's client.
        self.embedding_source = embedding_source if embedding_source is not None else executor.embedding_source
        use_async = config.async_scheduling
        if use_async is None:
            use_async = executor.is_accelerated
        self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="model-runner") if use_async else None
        # The step the executor is running now: (what was scheduled, its future result).
        self._in_flight: tuple | None = None
        # True when the last step scheduled nothing (every request waits on the encoder).
        self.last_step_was_empty = False

    def add_request(self, request: Request, items: list | None = None) -> None:
        """`items`: the request's preprocessed multimodal items, one per placeholder."""
        self._check_has_encoder(request)
        spec = request.sampling_params.structured_output
        if spec is not None:
            grammars = getattr(self.executor, "grammars", None)
            if grammars is None:
                raise ValueError("this engine has no grammar engine for structured output")
            # Compiled on the grammar engine's own thread; the request waits in the queue.
            request.grammar, request.grammar_asked_at = grammars.submit(spec, request.cache_salt), time.monotonic()
        self.scheduler.add_request(request)
        if request.mm_placeholders:
            self.embedding_source.register(request.request_id, items or [])

    def check_request(self, request: Request) -> None:
        """Raises ValueError if `add_request` would refuse the request; changes nothing."""
        self._check_has_encoder(request)
        self.scheduler.check_request(request)

    def _check_has_encoder(self, request: Request) -> None:
        if request.mm_placeholders and self.embedding_source is None:
            raise ValueError("this model takes no images or audio")

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        if self.embedding_source is not None:
            request_ids = list(request_ids)
            self._release_items(request_ids)
        self.scheduler.abort_requests(request_ids, status)

    def _release_items(self, request_ids) -> None:
        # By id: a finished request has already left the scheduler; releasing one that
        # registered nothing is a no-op.
        for request_id in request_ids:
            self.embedding_source.release(request_id)

    def _exchange_embeddings(self) -> None:
        """Ask the encoder for what the next step will need, then take what it delivered."""
        source = self.embedding_source
        if source is None:
            return
        wanted = self.scheduler.plan_encoder_inputs()
        if wanted:
            source.request(wanted)
        for mm_hash, embeddings, error in source.poll():
            self.scheduler.on_embeddings(mm_hash, embeddings, error)

    def _schedule(self):
        self._exchange_embeddings()
        sched = self.scheduler.schedule()
        self.last_step_was_empty = sched.is_empty
        if sched.is_empty and self.scheduler.waiting_on_grammar:
            # Nothing to run until a grammar compiles: wait a moment for it rather than
            # return at once, so a caller's step loop does not spin (and take the GIL from
            # the compile thread: measured, 89k empty steps and a first token 3 s later).
            wait([r.grammar for r in self.scheduler.waiting if r.grammar is not None and not r.grammar.done()],
                 timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        return sched

    def _update(self, sched, result) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(sched, result)
        if self.embedding_source is not None:
            self._release_items([o.request_id for o in outputs if o.finish_reason is not None])
        return outputs

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        if self._step_thread is not None:
            return self._step_pipelined()
        sched = self._schedule()
        result = self.executor.execute(sched)
        return self._update(sched, result)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            self._in_flight = self._submit(self._schedule())
        sched, future = self._in_flight
        # Schedule the next step while this one runs.
        upcoming = self._schedule() if self.scheduler.has_unfinished_requests else None
        outputs = self._update(sched, future.result())
        self._in_flight = self._submit(upcoming) if upcoming is not None else None
        return outputs

    def _submit(self, sched) -> tuple:
        future: Future = self._step_thread.submit(self.executor.execute, sched)
        return sched, future

    def close(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        self.executor.close()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache and its hit counters (False while requests hold blocks)."""
        return self.kv.reset_prefix_cache()

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
            image_tokens_in=self.scheduler.num_image_tokens_in,
            encoder_items_requested=self.scheduler.embeddings.num_requested,
            **self._encoder_cache_stats(),
        )

    def _encoder_cache_stats(self) -> dict:
        cache = getattr(self.embedding_source, "cache", None)
        if cache is None:
            return {}
        return dict(encoder_items_encoded=cache.stats.items_encoded, encoder_cache_queries=cache.stats.queries,
                    encoder_cache_hits=cache.stats.hits, encoder_cache_used=cache.used,
                    encoder_cache_budget=cache.budget)
