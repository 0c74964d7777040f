"""The server's Prometheus metrics, in prometheus-client's text format.

Most values live where they are counted (the engine's stats snapshot, the admission, the
encoder's stats) and are read at scrape time, so they are exported as families built per
scrape; the two latency histograms are prometheus-client's own. One registry per server, not the
library's global one: tests run several apps in a process."""

from __future__ import annotations

from collections import Counter

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.protocol import EncoderStats, EngineStatsSnapshot

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     10.0, 30.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST

# No `_created` series beside each histogram: nothing here reads them.
prometheus_client.disable_created_metrics()


class Metrics:
    def __init__(self) -> None:
        self.finished = Counter()
        self.in_flight = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_prompt_tokens = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("antiphon_time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.itl = Histogram("antiphon_inter_token_latency_seconds", "Time between consecutive tokens.",
                             buckets=LATENCY_BUCKETS_S, registry=self.registry)
        # The families of the scrape in progress (render sets them; the registry collects them).
        self._families: list = []
        self.registry.register(self)

    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self, finish_reason: str | None, prompt_tokens: int, output_tokens: int,
                         cached_tokens: int) -> None:
        self.in_flight -= 1
        self.finished[finish_reason or "unknown"] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += output_tokens
        self.cached_prompt_tokens += cached_tokens

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def collect(self):
        """prometheus-client's collector interface: this scrape's families."""
        return self._families

    def render(self, stats: EngineStatsSnapshot, healthy: bool, server_gauges: list[tuple[str, str, float]] = (),
               server_counters: list[tuple[str, str, float]] = (), encoder: EncoderStats | None = None) -> bytes:
        """`server_gauges` / `server_counters`: (name, help, value) owned by the server, not the engine."""
        encoder = encoder if encoder is not None else EncoderStats()
        gauges = [
            ("antiphon_requests_in_flight", "Requests streaming now.", self.in_flight),
            ("antiphon_requests_running", "Requests in the decoder's running batch.", stats.num_running),
            ("antiphon_requests_waiting", "Requests queued in the decoder.", stats.num_waiting),
            ("antiphon_kv_blocks_used", "KV cache blocks in use.", stats.kv_blocks_used),
            ("antiphon_kv_blocks_total", "KV cache blocks in the pool.", stats.kv_blocks_total),
            ("antiphon_healthy", "1 when every worker is up.", int(healthy)),
            *server_gauges,
            ("antiphon_encoder_cache_usage", "Embeddings held in the global encoder cache.", encoder.cache_used),
            ("antiphon_encoder_cache_budget", "Embeddings the global encoder cache may hold.", encoder.cache_budget),
            ("antiphon_encoder_cache_items", "Items held in the global encoder cache.", encoder.cache_items),
        ]
        counters = [
            ("antiphon_prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens),
            ("antiphon_generation_tokens_total", "Generated tokens of finished requests.", self.generation_tokens),
            ("antiphon_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_query_tokens),
            ("antiphon_prefix_cache_hits_total", "Prompt tokens served from the prefix cache.",
             stats.prefix_cache_hit_tokens),
            ("antiphon_preemptions_total", "Requests preempted for lack of KV blocks.", stats.num_preemptions),
            ("antiphon_image_tokens_total", "Image tokens in admitted prompts.", stats.image_tokens_in),
            ("antiphon_encoder_items_requested_total", "Items the decoder asked the encoder for (not covered "
             "by the prefix cache, nor already held for another request).", stats.encoder_items_requested),
            ("antiphon_encoder_items_encoded_total", "Items the vision encoder ran on.", encoder.items_encoded),
            ("antiphon_encoder_cache_queries_total", "Lookups in the global encoder cache.", encoder.cache_queries),
            ("antiphon_encoder_cache_hits_total", "Lookups the global encoder cache answered.", encoder.cache_hits),
            *server_counters,
        ]
        finished = CounterMetricFamily("antiphon_requests_total", "Finished requests by finish reason.",
                                       labels=["finish_reason"])
        for reason, count in sorted(self.finished.items()):
            finished.add_metric([reason], count)
        self._families = [finished]
        self._families += [GaugeMetricFamily(name, help_text, value=value) for name, help_text, value in gauges]
        self._families += [CounterMetricFamily(name, help_text, value=value) for name, help_text, value in counters]
        try:
            return generate_latest(self.registry)
        finally:
            self._families = []
