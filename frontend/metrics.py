"""The server's Prometheus metrics, written by prometheus-client's text exposition.

Every value lives where it is counted (the engine's stats snapshot, the admission, the
encoder's stats, the two latency histograms here) and becomes a metric family at scrape time.
The histograms are plain bucket counts, not prometheus-client's `Histogram`: one is observed
for every streamed token on the event loop, where the library's locks cost ~5x a bisect."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.protocol import EncoderStats, EngineStatsSnapshot

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     10.0, 30.0)
# The classic text format, whatever prometheus-client release is installed (newer ones name
# another version in CONTENT_TYPE_LATEST).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class LatencyHistogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    def family(self, name: str, help_text: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=self.sum)


# A data-parallel replica's series: row key -> (metric name, help, kind).
REPLICA_SERIES = {
    "healthy": ("antiphon_replica_healthy", "1 while the replica serves.", "gauge"),
    "running": ("antiphon_replica_requests_running", "Requests in the replica's running batch.", "gauge"),
    "waiting": ("antiphon_replica_requests_waiting", "Requests queued in the replica's decoder.", "gauge"),
    "in_flight": ("antiphon_replica_requests_in_flight", "Requests this front end has in flight there.", "gauge"),
    "kv_blocks_used": ("antiphon_replica_kv_blocks_used", "KV cache blocks in use.", "gauge"),
    "kv_blocks_total": ("antiphon_replica_kv_blocks_total", "KV cache blocks in the pool.", "gauge"),
    "prefix_blocks_indexed": ("antiphon_replica_prefix_blocks_indexed", "Cached blocks the router knows of.",
                              "gauge"),
    "routed": ("antiphon_replica_requests_routed_total", "Requests the router sent there.", "counter"),
    "routed_for_prefix": ("antiphon_replica_requests_routed_for_prefix_total", "Of those, sent for a cached "
                          "prefix (or a pinned conversation).", "counter"),
    "prefix_queries": ("antiphon_replica_prefix_cache_queries_total", "Prompt tokens looked up in its prefix "
                       "cache.", "counter"),
    "prefix_hits": ("antiphon_replica_prefix_cache_hits_total", "Prompt tokens its prefix cache served.", "counter"),
    "encoder_queries": ("antiphon_replica_encoder_cache_queries_total", "Lookups in its encoder cache.", "counter"),
    "encoder_hits": ("antiphon_replica_encoder_cache_hits_total", "Lookups its encoder cache answered.", "counter"),
    "restarts": ("antiphon_replica_worker_restarts_total", "Times its workers were restarted.", "counter"),
}


def replica_families(rows: list[dict]) -> list:
    if not rows:
        return []
    families = []
    for key, (name, help_text, kind) in REPLICA_SERIES.items():
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_text, labels=["replica"])
        for row in rows:
            family.add_metric([str(row["replica"])], row[key])
        families.append(family)
    return families


@dataclass(frozen=True)
class _Scrape:
    """What generate_latest walks: one scrape's families."""

    families: list

    def collect(self):
        return self.families


class Metrics:
    def __init__(self) -> None:
        self.finished = Counter()
        self.in_flight = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_prompt_tokens = 0
        self.ttft = LatencyHistogram()
        self.itl = LatencyHistogram()

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

    def render(self, stats: EngineStatsSnapshot, healthy: bool, server_gauges: list[tuple[str, str, float]] = (),
               server_counters: list[tuple[str, str, float]] = (), encoder: EncoderStats | None = None,
               replicas: list[dict] = ()) -> bytes:
        """`server_gauges` / `server_counters`: (name, help, value) owned by the server, not the engine.
        `replicas`: a data-parallel server's rows (ReplicaSet.replica_rows), one labelled series each."""
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
        families = [finished]
        families += [GaugeMetricFamily(name, help_text, value=value) for name, help_text, value in gauges]
        families += [CounterMetricFamily(name, help_text, value=value) for name, help_text, value in counters]
        families += replica_families(replicas)
        families.append(self.ttft.family("antiphon_time_to_first_token_seconds", "Time to first token."))
        families.append(self.itl.family("antiphon_inter_token_latency_seconds", "Time between consecutive tokens."))
        return generate_latest(_Scrape(families))
