"""/metrics is Prometheus' text format (prometheus-client), with the metric names dashboards use."""

from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import EncoderStats, EngineStatsSnapshot
from frontend.metrics import Metrics


def scrape(metrics: Metrics, **stats) -> dict[str, list]:
    text = metrics.render(EngineStatsSnapshot(**stats), True, [("antiphon_request_slots_held", "Held.", 3)],
                          [("antiphon_decoder_restarts_total", "Restarts.", 2)],
                          EncoderStats(cache_hits=5, cache_items=1)).decode()
    return {sample.name: sample for family in text_string_to_metric_families(text) for sample in family.samples} | {
        f"{sample.name}{sorted(sample.labels.items())}": sample
        for family in text_string_to_metric_families(text) for sample in family.samples if sample.labels}


def test_a_scrape_holds_every_kind_of_metric_with_its_value():
    metrics = Metrics()
    metrics.request_started()
    metrics.observe_ttft(0.02)
    metrics.observe_itl(0.004)
    metrics.request_finished("stop", 7, 3, 4)
    samples = scrape(metrics, kv_blocks_used=6, prefix_cache_hit_tokens=4)
    assert samples["antiphon_kv_blocks_used"].value == 6
    assert samples["antiphon_prefix_cache_hits_total"].value == 4
    assert samples["antiphon_generation_tokens_total"].value == 3
    assert samples["antiphon_request_slots_held"].value == 3
    assert samples["antiphon_decoder_restarts_total"].value == 2
    assert samples["antiphon_encoder_cache_hits_total"].value == 5
    assert samples["antiphon_requests_total[('finish_reason', 'stop')]"].value == 1
    assert samples["antiphon_time_to_first_token_seconds_count"].value == 1
    assert samples["antiphon_time_to_first_token_seconds_bucket[('le', '0.025')]"].value == 1
    assert samples["antiphon_time_to_first_token_seconds_bucket[('le', '0.01')]"].value == 0
    assert samples["antiphon_inter_token_latency_seconds_sum"].value == 0.004


def test_each_server_counts_on_its_own():
    """Two apps in one process (as the tests run them) do not share counts or clash on names."""
    first, second = Metrics(), Metrics()
    first.observe_ttft(0.5)
    assert scrape(first)["antiphon_time_to_first_token_seconds_count"].value == 1
    assert scrape(second)["antiphon_time_to_first_token_seconds_count"].value == 0
    # Scraping twice gives the same families (the per-scrape ones are not left registered).
    assert scrape(first).keys() == scrape(first).keys()
